// logfmt.cuh: LogFMT-10, the combine's optional row format (docs/contract.md "4.1 LogFMT"),
// bit-identical to ep_reference::numerics::logfmt (the math) and logfmt_wire (the bytes).
// IEEE f32 only, every rounding step written out (__fadd_rn, __fadd_rd, __fmul_rn, __fdiv_rn,
// __fmaf_rn: the module is compiled with --fmad=false anyway); no log2f/exp2f: the log is the
// exact table below plus the exponent, the exp the fixed polynomial below.
//
// A row of H = 128 G channels on the wire: G meta words of 4 bytes (amax bits | amin bits << 16,
// the magnitudes' largest and smallest bf16 bits), then the G bodies in channel order: 160 bytes
// for a packed group (field i, sign << 9 | code, at bits 10i..10i+9 of the body as one
// little-endian bit string), 256 for a raw one (its bf16 values). The encoder gives a group to
// 8 lanes: lane l holds channels 16l..16l+15, i.e. words 5l..5l+4 of a packed body (bits
// 160l..160l+159) and bytes 32l..32l+31 of a raw one. The decoder gives a group to a warp: lane
// j holds channels 4j..4j+3, bits 40j..40j+39 (bytes 5j..5j+4) of a packed body, bytes
// 8j..8j+7 of a raw one. Bodies start 4-aligned (metas and bodies are multiples of 4 bytes) in
// rows whose stride (KParams.cmb_row) is a multiple of 4.

#define LF_GROUP 128
#define LF_META_BYTES 4
#define LF_PACKED_BYTES 160
#define LF_RAW_BYTES 256
#define LF_TOP_CODE 511

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
// times 2^n. floor(y) is the round-down sum t = y + 1.5 * 2^23 less 1.5 * 2^23 (exact: |y| < 2^22,
// so t is an integer in [2^23, 2^24) and its low 9 bits are n's), one full-rate add where floorf
// is a conversion-unit instruction. The product p * 2^n is exact (the result is normal), so it is
// formed by adding n to p's exponent bits: t << 23 keeps n's low 9 bits. Bit-identical to the
// reference's floor and multiplication by pow2i(n) (reference/tests/logfmt_gpu_mirror.rs checks
// every code of many grids).
__device__ __forceinline__ float lf_exp2(float y) {
    const float t = __fadd_rd(y, 12582912.0f);
    const float f = __fsub_rn(y, __fsub_rn(t, 12582912.0f));
    float q = __uint_as_float(LF_EXP2_A6);
    q = __fmaf_rn(q, f, __uint_as_float(LF_EXP2_A5));
    q = __fmaf_rn(q, f, __uint_as_float(LF_EXP2_A4));
    q = __fmaf_rn(q, f, __uint_as_float(LF_EXP2_A3));
    q = __fmaf_rn(q, f, __uint_as_float(LF_EXP2_A2));
    q = __fmaf_rn(q, f, __uint_as_float(LF_EXP2_A1));
    const float p = __fmaf_rn(q, f, 1.0f);
    return __uint_as_float(__float_as_uint(p) + (__float_as_uint(t) << 23));
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
// The magnitude code c decodes to. -(511 - c) is formed as (2^23 + c) - (2^23 + 511), exact
// (no conversion instruction; for c = 511 it is +0 where the reference has -0, and la + 0 *
// step is la either way).
__device__ __forceinline__ float lf_magnitude(const LfGrid& g, u32 c) {
    const float cm = __fsub_rn(__uint_as_float(0x4B000000u | c), 8389119.0f);
    const float m = lf_exp2(__fmaf_rn(cm, g.step, g.la));
    return c == 0u ? 0.0f : m;
}
// The code of magnitude bits `a` (sign cleared, at most amax) in the packed group of meta word
// `meta`: the largest c in 0..511 with c == 0 or (m(c-1) + m(c)) * 0.5 <= a, found from the
// start c by the reference's corrections against the thresholds (which do not decrease), so
// the start never changes the result; m(c) is carried from one step to the next. The encoder's
// exact case, for the few values its estimate cannot settle. Out of line: one copy per module.
__device__ __noinline__ u32 lf_search(u32 meta, u32 a, u32 c) {
    const LfGrid g = lf_grid(meta);
    const float av = __uint_as_float(a << 16);
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

// ---- the encoder's estimate (reference/tests/logfmt_gpu_mirror.rs runs the same f32 steps on
// the CPU against the reference's codes, every magnitude of thousands of grids)
//
// For a packed group (la = log2 amax as lf_grid, E = amax's exponent, s = step) and a magnitude
// a, with exact real l = log2(a) and u = 511 + (l - la + h(s)) / s, h(s) = 1 - log2(1 + 2^-s):
// threshold(c) for c >= 2 is (m(c-1) + m(c)) / 2 with m(c) = 2^(la - (511 - c) s) within y's
// rounding (|y| 2^-24) and E's error (2e-7), so log2 threshold(c) = la - (511 - c) s - h(s) + d,
// |d| <= D = (|la| + 511 s) 2^-24 + 3.75e-7. Hence threshold(c) <= a for c <= u - D/s and > a for
// c > u + D/s: if no integer lies within D/s of u, the code is floor(u) where that is 2 or more,
// and 0 or 1 (threshold(1) decides) where it is 1 or less. The estimate of u - 511.5 is
//     v = fma(fa, 1/(128 s), fma(T'[a mod 128], 1/s, bc)),   clamped to at least -510,
// fa = a - 128 (E + 127) (exact: a and amax's exponent bits as the floats 2^23 + bits), T'[m] =
// log2(1 + m/128) - m/128 (the table less m/128, exact, within 2^-25 of the real value), bc =
// fma(-q, 1/s, -0.5), q = (la - E) - h~(s) (la - E is exact; h~ = s/2 - s^2 ln2/8, within 2.9e-8
// of h for s <= 32/510). It is within 2.18e-7/s + 4.6e-5 of u - 511.5 wherever it is not clamped
// (the error of 1/s is relative, 511 2^-24 on u - 511; table, q, bc and the inner fma's
// rounding 2.18e-7/s; the outer fma's 2^-16). The code is then 511 + rint(v) (rint by adding 1.5
// 2^23, so the code is the sum's bits less a constant) wherever |v - rint(v)| < 1/2 - margin,
// margin (A + B |E|) / s + K (LF_MARGIN_*: twice or more the (5.93e-7 + 5.96e-8 |E|) / s +
// 7.64e-5 the two bounds need, |la| <= |E|), and below threshold(2) it is 1 (a clamped v gives 1 too: its u
// is below 2). The few values whose fraction is nearer than that take lf_search; a value below
// threshold(1) gets 0 (only where amin is below it, a clipped grid).
#define LF_LN2_8 0x3DB17218u        // ln(2) / 8
#define LF_MARGIN_A 0x35A7C5ACu     // 1.25e-6
#define LF_MARGIN_B 0x340637BDu     // 1.25e-7
#define LF_MARGIN_K 0x3927C5ACu     // 1.6e-4
#define LF_MARGIN_MAX 0x3EE66666u   // 0.45: a larger margin (s below ~6e-5) leaves no fast case
// (row, group) units of one encoding round: a whole row at the largest H (MAX_HIDDEN / 128),
// one unit per thread in the round's per-group pass; and the rows of a round at most.
#define LF_UNITS 512
#define LF_ROWS 32
// Sets of 4 units (one a warp) whose loads the meta pass has in flight per warp.
#define LF_DEPTH 4
// The reduction's slot flags, above the body address.
#define LF_SLOT_PACKED (1ull << 61)
#define LF_SLOT_ZERO (1ull << 62)
#define LF_SLOT_VALID (1ull << 63)
// The encoder's shared memory, per round: each packed unit's estimate constants {1/s, bc, 1/2 -
// margin, threshold(1)'s bound} (lf_consts), its meta word, the packed flags (bit u of the unit
// u = j G + g of row j), the table T' (log2 table less m/128), each warp's staged bodies (4
// packed bodies of 40 words), and the round's row addresses (dst 0: a row not sent).
__shared__ float4 lf_s_rec[LF_UNITS];
__shared__ u32 lf_s_meta[LF_UNITS];
__shared__ u32 lf_s_mask[LF_UNITS / 32];
__shared__ float lf_s_log2[128];
__shared__ u32 lf_s_stage[NWARPS * 4 * 40];
__shared__ u64 lf_s_dst[LF_ROWS];
__shared__ u64 lf_s_src[LF_ROWS];

// Thread 0's %globaltimer stamp into phase slot i of this block (common.cuh PROF), from a
// function that has the profile buffer but not the KParams.
__device__ __forceinline__ void lf_stamp(u64 prof, int i) {
    if (prof && threadIdx.x == 0) ((u64*)prof)[blockIdx.x * PROF_SLOTS + i] = globaltimer();
}

// The bound of threshold(1) in magnitude bits: a < lf_zero_bound(g) iff float(a) < m(1) / 2
// (m(1)'s half, rounded up to the next bf16: a bf16 is below a positive f32 iff its bits << 16
// are). A group whose amin is not below it has no code 0.
__device__ __forceinline__ u32 lf_zero_bound(const LfGrid& g) {
    const float thr1 = __fmul_rn(lf_magnitude(g, 1u), 0.5f);
    return (__float_as_uint(thr1) + 0xFFFFu) >> 16;
}
// A packed group's estimate constants (see above): {1/s, bc, 1/2 - margin (0: no fast case),
// 2^23 + lf_zero_bound as float bits where amin is below it (else 0: no code 0)}.
__device__ __forceinline__ float4 lf_consts(u32 meta) {
    const LfGrid gr = lf_grid(meta);
    const float e = (float)((int)((meta & 0xFFFFu) >> 7) - 127);
    const float s = gr.step;
    const float hh = __fsub_rn(__fmul_rn(s, 0.5f), __fmul_rn(__fmul_rn(s, s), __uint_as_float(LF_LN2_8)));
    const float rs = __fdiv_rn(1.0f, s);
    const float q = __fsub_rn(__fsub_rn(gr.la, e), hh);
    const float bc = __fmaf_rn(-q, rs, -0.5f);
    const float m = __fmaf_rn(__fmaf_rn(__uint_as_float(LF_MARGIN_B), -e, __uint_as_float(LF_MARGIN_A)), rs,
                              __uint_as_float(LF_MARGIN_K));
    const float mh = m < __uint_as_float(LF_MARGIN_MAX) ? __fsub_rn(0.5f, m) : 0.0f;
    const u32 k1 = lf_zero_bound(gr);
    const u32 zb = (meta >> 16) < k1 ? 0x4B000000u + k1 : 0u;
    return make_float4(rs, bc, mh, __uint_as_float(zb));
}
// The estimate for the magnitude a in half HI of a bf16 word (lo: bits 0..15, else 16..31): its
// code 511 + rint(v) (v clamped, above) and r = v - rint(v); `mg` is a as the float 2^23 + a.
// kf = 2^23 + amax's exponent bits, rs = 1/s, r128 = rs / 128, bc as above.
template <bool HI>
__device__ __forceinline__ u32 lf_estimate(u32 wm, float kf, float rs, float r128, float bc, u32& mg, float& r) {
    // wm: the bf16 word with its signs cleared; mg = 2^23 + a as float bits, by a byte permute.
    mg = __byte_perm(wm, 0x4B000000u, HI ? 0x7632u : 0x7610u);
    const u32 ti = HI ? ((wm >> 14) & 0x1FCu) : ((wm << 2) & 0x1FCu);  // 4 (a mod 128): T' byte offset
    const float tm = *(const float*)((const u8*)lf_s_log2 + ti);
    const float fa = __fsub_rn(__uint_as_float(mg), kf);
    const float v = fmaxf(__fmaf_rn(fa, r128, __fmaf_rn(tm, rs, bc)), -510.0f);
    const float t = __fadd_rn(v, 12582912.0f);
    r = __fsub_rn(v, __fsub_rn(t, 12582912.0f));
    return __float_as_uint(t) - 0x4B3FFE01u;
}

// Encodes the round's nr rows (nr <= LF_ROWS, nr * H / 128 <= LF_UNITS): row j is the bf16 row
// at lf_s_src[j] (16-aligned), written to lf_s_dst[j] (4-aligned, room for G (4 + 256) bytes),
// skipped where lf_s_dst[j] is 0. The whole block calls it (barriers): the caller writes the
// row table, the first barrier here publishes it, the last one ends every use of it. Three
// passes over the round's (row, group) units u = j G + g, each unit to 8 lanes (lane l of the 8:
// channels 16l..16l+15, bytes 32l..32l+31 of its bf16 group), 4 units a warp: (A) the meta words
// (stored to the row too), LF_DEPTH sets of 4 units in flight per warp; (B) each thread a packed
// unit's constants; (C) the codes: each lane its 16 fields, packed into its 5 words of the body,
// staged in shared memory and stored as 5 runs of 8 words (32 bytes), the body at the offset its
// row's packed flags give. Stamps p9 after A and p10 after B (the last round's). Out of line
// (scalar arguments): one copy per module.
__device__ __noinline__ void lf_encode_rows(int nr, int H, u64 prof) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int sg = lane >> 3, sl = lane & 7;
    const int G = H / LF_GROUP;
    const int units = nr * G;
    const float rg = 1.0f / (float)G;
    __syncthreads();
    if (tid < 128) lf_s_log2[tid] = __fsub_rn(__uint_as_float(LF_LOG2_MANTISSA[tid]), (float)tid * 0.0078125f);
    // (A) Magnitudes two to a word; per lane the largest and smallest of its 16, then of the
    // unit's 8 lanes as one word (largest, 0x7FFF - smallest) reduced by halfword maxima.
    for (int u0 = 4 * warp; u0 < units; u0 += 4 * NWARPS * LF_DEPTH) {
        uint4 x[LF_DEPTH][2];
#pragma unroll
        for (int d = 0; d < LF_DEPTH; d++) {
            const int u = u0 + 4 * NWARPS * d + sg;
            const bool on = u < units;
            const int j = on ? div_rcp(u, G, rg) : 0, g = u - j * G;
            const u64 dst = on ? lf_s_dst[j] : 0ull;
            x[d][0] = make_uint4(0u, 0u, 0u, 0u);
            x[d][1] = x[d][0];
            if (dst) {
                const uint4* s = (const uint4*)(lf_s_src[j] + (u64)g * LF_RAW_BYTES + sl * 32);
                x[d][0] = __ldg(s);
                x[d][1] = __ldg(s + 1);
            }
        }
#pragma unroll
        for (int d = 0; d < LF_DEPTH; d++) {
            const u32 m0 = x[d][0].x & 0x7FFF7FFFu, m1 = x[d][0].y & 0x7FFF7FFFu, m2 = x[d][0].z & 0x7FFF7FFFu;
            const u32 m3 = x[d][0].w & 0x7FFF7FFFu, m4 = x[d][1].x & 0x7FFF7FFFu, m5 = x[d][1].y & 0x7FFF7FFFu;
            const u32 m6 = x[d][1].z & 0x7FFF7FFFu, m7 = x[d][1].w & 0x7FFF7FFFu;
            const u32 hi = __vmaxu2(__vmaxu2(__vmaxu2(m0, m1), __vmaxu2(m2, m3)), __vmaxu2(__vmaxu2(m4, m5), __vmaxu2(m6, m7)));
            const u32 lo = __vminu2(__vminu2(__vminu2(m0, m1), __vminu2(m2, m3)), __vminu2(__vminu2(m4, m5), __vminu2(m6, m7)));
            u32 pk = max(hi & 0xFFFFu, hi >> 16) | ((0x7FFFu - min(lo & 0xFFFFu, lo >> 16)) << 16);
            pk = __vmaxu2(pk, __shfl_xor_sync(0xffffffffu, pk, 4));
            pk = __vmaxu2(pk, __shfl_xor_sync(0xffffffffu, pk, 2));
            pk = __vmaxu2(pk, __shfl_xor_sync(0xffffffffu, pk, 1));
            const int u = u0 + 4 * NWARPS * d + sg;
            if (sl == 0 && u < units) {
                const u32 meta = (pk & 0xFFFFu) | ((0x7FFFu - (pk >> 16)) << 16);  // 0 for a row not sent: not packed
                lf_s_meta[u] = meta;
                const int j = div_rcp(u, G, rg), g = u - j * G;
                if (lf_s_dst[j]) *(u32*)(lf_s_dst[j] + (u64)g * LF_META_BYTES) = meta;
            }
        }
    }
    __syncthreads();
    lf_stamp(prof, 9);
    // (B) One unit a thread: the packed flags, and a packed unit's constants.
    for (int u = tid; u < LF_UNITS; u += NTHREADS) {
        const u32 meta = u < units ? lf_s_meta[u] : 0u;
        const bool pk = lf_packed(meta);
        const u32 bm = __ballot_sync(0xffffffffu, pk);
        if (lane == 0) lf_s_mask[u >> 5] = bm;
        if (pk) lf_s_rec[u] = lf_consts(meta);
    }
    __syncthreads();
    lf_stamp(prof, 10);
    // (C) Lane l of a unit's 8: fields 16l..16l+15, i.e. words 5l..5l+4 of a packed body.
    u32* const stage = lf_s_stage + warp * 160 + sg * 40;
    // Unit u = u0 + sg as (row uj, group ug), advanced by 4 NWARPS units a pass.
    const int dj = (4 * NWARPS) / G, dg = 4 * NWARPS - dj * G;
    int uj = div_rcp(4 * warp + sg, G, rg), ug = 4 * warp + sg - uj * G;
    for (int u0 = 4 * warp; u0 < units; u0 += 4 * NWARPS) {
        const int u = u0 + sg;
        const bool on = u < units;
        const int j = on ? uj : 0, g = on ? ug : 0;
        ug += dg;
        uj += dj;
        if (ug >= G) {
            ug -= G;
            uj++;
        }
        const u64 dst = on ? lf_s_dst[j] : 0ull;
        const u8* src = (const u8*)lf_s_src[j] + (u64)g * LF_RAW_BYTES;
        uint4 x0 = make_uint4(0u, 0u, 0u, 0u), x1 = x0;
        if (dst) {
            x0 = __ldg((const uint4*)(src + sl * 32));
            x1 = __ldg((const uint4*)(src + sl * 32 + 16));
        }
        const u32 meta = on ? lf_s_meta[u] : 0u;
        const bool pk = dst && lf_packed(meta);
        // Packed groups before g in row j: bits jG .. jG+g-1 of the flags, a word at a time.
        int np = 0;
#pragma unroll 1
        for (int b = j * G, b1 = b + g; b < b1;) {
            const int o = b & 31, n = min(32 - o, b1 - b);
            np += __popc((lf_s_mask[b >> 5] >> o) & (n == 32 ? 0xFFFFFFFFu : (1u << n) - 1u));
            b += n;
        }
        u8* body = (u8*)dst + (u32)G * LF_META_BYTES + (u32)np * LF_PACKED_BYTES + (u32)(g - np) * LF_RAW_BYTES;
        const u32 xw[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
        // A raw or absent unit computes on stale constants; nothing of it is stored.
        const float4 rc = lf_s_rec[u & (LF_UNITS - 1)];
        const float kf = __uint_as_float(0x4B000000u | (meta & 0x7F80u));
        const float r128 = __fmul_rn(rc.x, 0.0078125f);
        // Fields (sign << 9 | code) at bits 10i of the lane's 160, in its 5 words.
        u32 wd[5] = {0u, 0u, 0u, 0u, 0u};
        u32 slow = 0u;  // bit i: value i's |v - rint(v)| is within the margin of 1/2
#pragma unroll
        for (int i = 0; i < 16; i++) {
            float r;
            u32 m;
            const u32 c = (i & 1) ? lf_estimate<true>(xw[i >> 1] & 0x7FFF7FFFu, kf, rc.x, r128, rc.y, m, r)
                                  : lf_estimate<false>(xw[i >> 1] & 0x7FFF7FFFu, kf, rc.x, r128, rc.y, m, r);
            if (!(fabsf(r) < rc.z)) slow |= 1u << i;
            const u32 f = c | (((i & 1) ? (xw[i >> 1] >> 22) : (xw[i >> 1] >> 6)) & 0x200u);
            const int b = 10 * i, k = b >> 5, o = b & 31;
            wd[k] += f << o;  // disjoint bits: + is |
            if (o > 22) wd[k + 1] += f >> (32 - o);
        }
        // Below threshold(1): code 0 (only a clipped grid has such values); the sign stays.
        const u32 zb = __float_as_uint(rc.w);
        if (__any_sync(0xffffffffu, pk && zb != 0u)) {
#pragma unroll
            for (int i = 0; i < 16; i++) {
                const u32 a = ((i & 1) ? (xw[i >> 1] >> 16) : xw[i >> 1]) & 0x7FFFu;
                const int b = 10 * i, k = b >> 5, o = b & 31;
                if ((0x4B000000u | a) < zb) {
                    wd[k] &= ~((u32)LF_TOP_CODE << o);
                    if (o > 23) wd[k + 1] &= ~((u32)LF_TOP_CODE >> (32 - o));
                }
            }
        }
#pragma unroll
        for (int k = 0; k < 5; k++) stage[5 * sl + k] = wd[k];
        // The values the estimate does not settle: the exact search from its code, patched into
        // the staged words (the whole field: an estimate of 512 would have set the sign's bit).
        if (!pk) slow = 0u;
        if (__any_sync(0xffffffffu, slow != 0u)) {
            while (slow) {
                const int i = __ffs(slow) - 1;
                slow &= slow - 1u;
                const u32 x = __ldg((const u16*)src + 16 * sl + i), a = x & 0x7FFFu;
                float r;
                u32 m;
                const u32 e = lf_estimate<false>(a, kf, rc.x, r128, rc.y, m, r);
                const u32 f = lf_search(meta, a, min(e, (u32)LF_TOP_CODE)) | ((x >> 6) & 0x200u);
                const int b = 10 * i, o = b & 31;
                u32* wp = stage + 5 * sl + (b >> 5);
                wp[0] = (wp[0] & ~(0x3FFu << o)) | (f << o);
                if (o > 22) wp[1] = (wp[1] & ~(0x3FFu >> (32 - o))) | (f >> (32 - o));
            }
        }
        __syncwarp();
        if (pk) {
#pragma unroll
            for (int k = 0; k < 5; k++) *(u32*)(body + 4 * (sl + 8 * k)) = stage[sl + 8 * k];
        } else if (dst) {
#pragma unroll
            for (int k = 0; k < 8; k++) *(u32*)(body + 4 * (sl + 8 * k)) = __ldg((const u32*)src + sl + 8 * k);
        }
        __syncwarp();
    }
    __syncthreads();
}

// The combine reduction of docs/contract.md over LogFMT rows (H a multiple of 128): for each
// token t and channel h, acc = 0; for k ascending over valid slots (sk[t*K+k] >= 0): acc =
// fma(w[t][k], value(row(t, k), h), acc); out = bf16_rne(acc), the value a packed field's
// magnitude with its sign (lf_magnitude) or a raw group's bf16. Row (t, k) is the encoded row
// at cbuf + (t*K + k) * crow, where its owner put it (both paths; LogFMT never reads in place
// nor through NCCL). The (token, group) pairs are split into equal runs, one per warp of the
// rank's blocks. Lane k < K keeps slot k's row, weight, meta word and the offset of its body
// (at the start of a run, the packed groups before it counted by the whole warp, 32 meta words
// a load and a ballot; then advanced group by group), and hands the grid and the body address
// to every lane by shuffles, the address's top bits flagging a packed group and one whose amin
// is below threshold(1) (the only groups with a code 0: lf_zero_bound); lane j decodes channels
// 4j..4j+3, the loads of up to 8 slots issued before any is used. Stamps p14 when warp 0's run
// is set up. Out of line (scalar arguments): one copy per module.
__device__ __noinline__ void lf_reduce_at(u64 cbuf, u64 crow, const int* sk, int n, int H, int K, int bid, int blocks_per_rank,
                                          u64 weights, u64 outp, u64 prof) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int G = H / LF_GROUP;
    const u64 P = (u64)n * (u64)G;
    const u64 nw = (u64)blocks_per_rank * NWARPS, wi = (u64)bid * NWARPS + warp;
    const u64 p0 = wi * P / nw, p1 = (wi + 1) * P / nw;
    if (p0 >= p1) return;
    const float* wts = (const float*)weights;
    u16* out = (u16*)outp;
    int t = (int)(p0 / (u64)G), g = (int)(p0 - (u64)t * G);
    bool mine = false;
    const u8* row = 0;
    float my_w = 0.0f;
    u32 my_at = 0u, meta = 0u;
    // Slot `lane` of token t at group g: its row, weight, body offset and meta word.
    auto token = [&]() {
        mine = lane < K && sk[t * K + lane] >= 0;
        row = mine ? (const u8*)cbuf + ((u64)t * K + lane) * crow : (const u8*)0;
        my_w = mine ? wts[t * K + lane] : 0.0f;
        meta = mine ? __ldcg((const u32*)(row + (u64)g * LF_META_BYTES)) : 0u;
        u32 np = 0u;
        // Packed groups before g of each slot: 32 meta words a load (lane j: word j0 + j) of 8
        // slots at once, counted by a ballot.
        for (int k0 = 0; k0 < K; k0 += 8) {
            for (int j0 = 0; j0 < g; j0 += 32) {
                const int j = j0 + lane;
                u32 m[8];
#pragma unroll
                for (int q = 0; q < 8; q++) {
                    const int k = k0 + q;
                    const bool on = k < K && j < g && sk[t * K + k] >= 0;
                    m[q] = on ? __ldcg((const u32*)((const u8*)cbuf + ((u64)t * K + k) * crow + (u64)j * LF_META_BYTES)) : 0u;
                }
#pragma unroll
                for (int q = 0; q < 8; q++) {
                    const u32 cnt = __popc(__ballot_sync(0xffffffffu, lf_packed(m[q])));
                    if (lane == k0 + q) np += cnt;
                }
            }
        }
        my_at = (u32)G * LF_META_BYTES + np * LF_PACKED_BYTES + ((u32)g - np) * LF_RAW_BYTES;
    };
    token();
    if (warp == 0) lf_stamp(prof, 14);
    // Lane j's bytes of a packed body: 5j .. 5j + 4, read as the two words from 5j rounded down.
    const u32 poff = (u32)((5 * lane) & ~3), psh = (u32)(8 * ((5 * lane) & 3));
    for (u64 pp = p0; pp < p1; pp++) {
        const bool pk = lf_packed(meta);
        LfGrid gr;
        gr.la = 0.0f;
        gr.step = 0.0f;
        // Slot lane's body address, flags in bits 61..63 (above every device address): 63 a
        // valid slot, 61 packed, 62 a code 0 possible. A lane without a slot has cbuf, which
        // the others read and ignore (no predicated load).
        u64 body = mine ? ((u64)row + my_at) | LF_SLOT_VALID : cbuf;
        if (pk) {
            gr = lf_grid(meta);
            body |= (meta >> 16) < lf_zero_bound(gr) ? LF_SLOT_PACKED | LF_SLOT_ZERO : LF_SLOT_PACKED;
        }
        // The next pair's meta word, in flight during this one (same token only).
        const bool same = g + 1 < G && pp + 1 < p1;
        const u32 meta_next = same && mine ? __ldcg((const u32*)(row + (u64)(g + 1) * LF_META_BYTES)) : 0u;
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int k0 = 0; k0 < K; k0 += 8) {
            // fl: the slot's flags (bit 0 packed, 1 a code 0 possible, 2 valid; 0: no slot).
            u32 d0[8], d1[8], fl[8];
#pragma unroll
            for (int q = 0; q < 8; q++) {
                const int k = k0 + q;
                const u64 b = __shfl_sync(0xffffffffu, body, k & 31);
                fl[q] = k < K ? (u32)(b >> 61) : 0u;
                const u32* w = (const u32*)((b & (LF_SLOT_PACKED - 1ull)) + ((fl[q] & 1u) ? poff : (u32)(8 * lane)));
                d0[q] = __ldcg(w);
                d1[q] = __ldcg(w + 1);
            }
#pragma unroll
            for (int q = 0; q < 8; q++) {
                const int k = k0 + q;
                const float la = __shfl_sync(0xffffffffu, gr.la, k & 31);
                const float st = __shfl_sync(0xffffffffu, gr.step, k & 31);
                const float w = __shfl_sync(0xffffffffu, my_w, k & 31);
                if (!fl[q]) continue;
                float v[4];
                if (fl[q] & 1u) {
                    // Fields at bits 0, 10, 20, 30 of the lane's 40 (lo: 0..31, hi: 32..39).
                    const u32 lo = __funnelshift_r(d0[q], d1[q], psh), hi = d1[q] >> psh;
                    const u32 x[4] = {lo, lo >> 10, lo >> 20, __funnelshift_r(lo, hi, 30)};
                    const u32 sg[4] = {lo << 22, lo << 12, lo << 2, hi << 24};  // sign bits at 31
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        const float cm = __fsub_rn(__uint_as_float(0x4B000000u | (x[i] & LF_TOP_CODE)), 8389119.0f);
                        const float m = lf_exp2(__fmaf_rn(cm, st, la));
                        v[i] = __uint_as_float(__float_as_uint(m) | (sg[i] & 0x80000000u));
                    }
                    if (fl[q] & 2u) {
#pragma unroll
                        for (int i = 0; i < 4; i++)
                            if ((x[i] << 23) == 0u) v[i] = 0.0f;  // code 0: zero (its sign adds nothing)
                    }
                } else {
                    v[0] = __uint_as_float(d0[q] << 16);
                    v[1] = __uint_as_float(d0[q] & 0xFFFF0000u);
                    v[2] = __uint_as_float(d1[q] << 16);
                    v[3] = __uint_as_float(d1[q] & 0xFFFF0000u);
                }
#pragma unroll
                for (int i = 0; i < 4; i++) acc[i] = __fmaf_rn(w, v[i], acc[i]);
            }
        }
        uint2 o;
        o.x = (u32)f32_to_bf16_rne(acc[0]) | ((u32)f32_to_bf16_rne(acc[1]) << 16);
        o.y = (u32)f32_to_bf16_rne(acc[2]) | ((u32)f32_to_bf16_rne(acc[3]) << 16);
        *(uint2*)(out + (u64)t * H + (u64)g * LF_GROUP + 4 * lane) = o;
        if (mine) my_at += pk ? LF_PACKED_BYTES : LF_RAW_BYTES;
        if (same) {
            g++;
            meta = meta_next;
        } else if (pp + 1 < p1) {
            g = 0;
            t++;
            token();
        }
    }
}
__device__ __forceinline__ void lf_reduce_tokens(const KParams& p, const IoPtrs& io, const RankPtrs& me, int n, const int* sk, int bid) {
    lf_reduce_at(me.cmb_buf, (u64)p.cmb_row, sk, n, p.H, p.K, bid, p.blocks_per_rank, io.weights, io.out, p.prof);
}
