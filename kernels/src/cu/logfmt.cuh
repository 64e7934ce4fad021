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
// times 2^n. The product p * 2^n is exact (the result is normal), so it is formed by adding n to
// p's exponent bits: n + 1.5 * 2^23 is exact and its low 9 bits are n's, which is all n << 23
// keeps. Bit-identical to the reference's multiplication by pow2i(n)
// (reference/tests/logfmt_gpu_mirror.rs checks every code of many grids).
__device__ __forceinline__ float lf_exp2(float y) {
    const float n = floorf(y);
    const float f = __fsub_rn(y, n);
    float q = __uint_as_float(LF_EXP2_A6);
    q = __fmaf_rn(q, f, __uint_as_float(LF_EXP2_A5));
    q = __fmaf_rn(q, f, __uint_as_float(LF_EXP2_A4));
    q = __fmaf_rn(q, f, __uint_as_float(LF_EXP2_A3));
    q = __fmaf_rn(q, f, __uint_as_float(LF_EXP2_A2));
    q = __fmaf_rn(q, f, __uint_as_float(LF_EXP2_A1));
    const float p = __fmaf_rn(q, f, 1.0f);
    const u32 nb = __float_as_uint(__fadd_rn(n, 12582912.0f));
    return __uint_as_float(__float_as_uint(p) + (nb << 23));
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
// a >= threshold(2), with exact real l = log2(a) and u = 511 + (l - la + h(s)) / s,
// h(s) = 1 - log2(1 + 2^-s): threshold(c) for c >= 2 is (m(c-1) + m(c)) / 2 with m(c) =
// 2^(la - (511 - c) s) within y's rounding (|y| 2^-24) and E's error (2e-7), so log2
// threshold(c) = la - (511 - c) s - h(s) + d, |d| <= (|la| + 511 s) 2^-24 + 3.75e-7. Hence
// threshold(c) <= a for c < u - |d|/s and > a for c > u + |d|/s: if no integer lies within
// |d|/s of u, the code is min(floor(u), 511). The estimate is v = ((a_exp - E) + (T[a_mant] -
// q)) * (1/s), q = (la - E) - h~(s) (la - E is exact; h~ = s/2 - s^2 ln2/8, within 2.9e-8 of
// h for s <= 32/510), which is within 1.49e-7/s + 9.2e-5 of u - 511 (table, q and sum
// roundings, then the product's). The margin needed on the fraction of v is therefore
// (5.24e-7 + 6e-8 |E|) / s + 1.228e-4 (|la| <= |E|); LF_MARGIN_* give twice that or more, and
// a value whose fraction is not that far from an integer takes lf_search. Below threshold(2)
// the code is 0 or 1, decided by threshold(1) directly.
#define LF_LN2_8 0x3DB17218u        // ln(2) / 8
#define LF_MARGIN_A 0x35A7C5ACu     // 1.25e-6
#define LF_MARGIN_B 0x340637BDu     // 1.25e-7
#define LF_MARGIN_K 0x3983126Fu     // 2.5e-4
#define LF_MARGIN_MAX 0x3EE66666u   // 0.45: a larger margin (s below ~6e-5) leaves no fast case
// (row, group) units of one encoding round: a whole row at the largest H (MAX_HIDDEN / 128),
// one unit per thread in the round's per-group pass; and the rows of a round at most.
#define LF_UNITS 512
#define LF_ROWS 32
// The encoder's shared memory, per round: each unit's estimate constants (q, 1/s, threshold(2),
// threshold(1)), its meta word and margin, the packed flags (bit u of the unit u = j G + g of
// row j), the log2 table, and the round's row addresses (dst 0: a row not sent).
__shared__ float4 lf_s_rec[LF_UNITS];
__shared__ uint2 lf_s_meta[LF_UNITS];
__shared__ u32 lf_s_mask[LF_UNITS / 32];
__shared__ u32 lf_s_log2[128];
__shared__ u64 lf_s_dst[LF_ROWS];
__shared__ u64 lf_s_src[LF_ROWS];

// Thread 0's %globaltimer stamp into phase slot i of this block (common.cuh PROF), from a
// function that has the profile buffer but not the KParams.
__device__ __forceinline__ void lf_stamp(u64 prof, int i) {
    if (prof && threadIdx.x == 0) ((u64*)prof)[blockIdx.x * PROF_SLOTS + i] = globaltimer();
}

// The code of magnitude bits `a` from the estimate (above), with the unit's constants `rc`,
// margin (mg, mhi) and `eb` = 2^23 + amax's biased exponent; sets `slow` where the value needs
// lf_search (the return value is then its start).
__device__ __forceinline__ u32 lf_code_fast(const float4& rc, float mg, float mhi, float eb, u32 a, u32& slow) {
    const float av = __uint_as_float(a << 16);
    const float fdi = __fsub_rn(__uint_as_float(0x4B000000u | (a >> 7)), eb);  // exponent difference, exact
    const float dt = __fsub_rn(__uint_as_float(lf_s_log2[a & 0x7Fu]), rc.x);
    const float v = __fmul_rn(__fadd_rn(fdi, dt), rc.y);
    const float n = floorf(v);
    const float r = __fsub_rn(v, n);
    const int c = 511 + __float2int_rz(n);
    const bool low = !(av >= rc.z);  // below threshold(2): code 0 or 1
    const bool fast = r > mg && r < mhi;
    slow = (!low && !fast) ? 1u : 0u;
    if (low) return av >= rc.w ? 1u : 0u;
    return fast ? (u32)min(c, 511) : (u32)min(max(c, 0), 511);
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

// Encodes the round's nr rows (nr <= LF_ROWS, nr * H / 128 <= LF_UNITS): row j is the bf16 row
// at lf_s_src[j] (16-aligned), written to lf_s_dst[j] (4-aligned, room for G (4 + 256) bytes),
// skipped where lf_s_dst[j] is 0. The whole block calls it (barriers): the caller writes the
// row table, the first barrier here publishes it, the last one ends every use of it. Three
// passes over the round's (row, group) units: (A) each half-warp a group's meta word (stored to
// the row too), (B) each thread a packed group's constants, (C) each warp a group's codes and
// body, at the offset its row's packed flags give. Stamps p9 after A and p10 after B (the last
// round's). Out of line (scalar arguments): one copy per module.
__device__ __noinline__ void lf_encode_rows(int nr, int H, u64 prof) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int G = H / LF_GROUP;
    const int units = nr * G;
    const float rg = 1.0f / (float)G;
    __syncthreads();
    if (tid < 128) lf_s_log2[tid] = LF_LOG2_MANTISSA[tid];
    {
        // (A) Lanes 16h..16h+15 take unit 2i+h, 8 channels a lane (16 bytes).
        const int h = lane >> 4, sl = lane & 15;
        for (int ub = 2 * warp; ub < units; ub += 2 * NWARPS) {
            const int u = ub + h;
            const bool on = u < units;
            const int j = on ? div_rcp(u, G, rg) : 0, g = u - j * G;
            const u64 dst = on ? lf_s_dst[j] : 0ull;
            uint4 x = make_uint4(0u, 0u, 0u, 0u);
            if (dst) x = *(const uint4*)(lf_s_src[j] + (u64)g * LF_RAW_BYTES + sl * 16);
            // Magnitudes two to a word; the largest and smallest of each half-word, then of both.
            const u32 m0 = x.x & 0x7FFF7FFFu, m1 = x.y & 0x7FFF7FFFu, m2 = x.z & 0x7FFF7FFFu, m3 = x.w & 0x7FFF7FFFu;
            const u32 hi = __vmaxu2(__vmaxu2(m0, m1), __vmaxu2(m2, m3));
            const u32 lo = __vminu2(__vminu2(m0, m1), __vminu2(m2, m3));
            u32 mx = max(hi & 0xFFFFu, hi >> 16), mn = min(lo & 0xFFFFu, lo >> 16);
#pragma unroll
            for (int o = 8; o > 0; o >>= 1) {
                mx = max(mx, __shfl_xor_sync(0xffffffffu, mx, o));
                mn = min(mn, __shfl_xor_sync(0xffffffffu, mn, o));
            }
            if (sl == 0 && on) {
                const u32 meta = mx | (mn << 16);  // 0 for a row not sent: not packed
                lf_s_meta[u].x = meta;
                if (dst) *(u32*)(dst + (u64)g * LF_META_BYTES) = meta;
            }
        }
    }
    __syncthreads();
    lf_stamp(prof, 9);
    // (B) One unit a thread: the packed flags, and a packed group's constants.
    for (int u = tid; u < LF_UNITS; u += NTHREADS) {
        const u32 meta = u < units ? lf_s_meta[u].x : 0u;
        const bool pk = lf_packed(meta);
        const u32 bm = __ballot_sync(0xffffffffu, pk);
        if (lane == 0) lf_s_mask[u >> 5] = bm;
        if (pk) {
            const LfGrid gr = lf_grid(meta);
            const float e = (float)((int)((meta & 0xFFFFu) >> 7) - 127);
            const float s = gr.step;
            const float hh = __fsub_rn(__fmul_rn(s, 0.5f), __fmul_rn(__fmul_rn(s, s), __uint_as_float(LF_LN2_8)));
            const float rs = __fdiv_rn(1.0f, s);
            const float m = __fmaf_rn(__fmaf_rn(__uint_as_float(LF_MARGIN_B), -e, __uint_as_float(LF_MARGIN_A)), rs,
                                      __uint_as_float(LF_MARGIN_K));
            const float m1 = lf_magnitude(gr, 1u), m2 = lf_magnitude(gr, 2u);
            lf_s_rec[u] = make_float4(__fsub_rn(__fsub_rn(gr.la, e), hh), rs, __fmul_rn(__fadd_rn(m1, m2), 0.5f), __fmul_rn(m1, 0.5f));
            lf_s_meta[u].y = __float_as_uint(m < __uint_as_float(LF_MARGIN_MAX) ? m : 0.5f);
        }
    }
    __syncthreads();
    lf_stamp(prof, 10);
    // (C) A warp a unit: lane j holds channels 4j..4j+3, bits 40j..40j+39 of a packed body.
    for (int u = warp; u < units; u += NWARPS) {
        const int j = div_rcp(u, G, rg), g = u - j * G;
        const u64 dst = lf_s_dst[j];
        if (!dst) continue;
        const uint2 v = *(const uint2*)(lf_s_src[j] + (u64)g * LF_RAW_BYTES + lane * 8);
        // Packed groups before g in row j: bits jG .. jG+g-1 of the flags.
        const int b0 = j * G, b1 = b0 + g;
        int np = 0;
        for (int w = b0 >> 5; w < ((b1 + 31) >> 5); w++) {
            const int lo = max(b0 - 32 * w, 0), hi = min(b1 - 32 * w, 32);
            const u32 m = (hi >= 32 ? 0xFFFFFFFFu : ((1u << hi) - 1u)) & ~((1u << lo) - 1u);
            np += __popc(lf_s_mask[w] & m);
        }
        u8* body = (u8*)dst + (u32)G * LF_META_BYTES + (u32)np * LF_PACKED_BYTES + (u32)(g - np) * LF_RAW_BYTES;
        const uint2 mm = lf_s_meta[u];
        // Channel i of this lane: bits 16(i % 2).. of word i / 2.
        auto bf = [&](int i) -> u32 { return ((i < 2 ? v.x : v.y) >> (16 * (i & 1))) & 0xFFFFu; };
        if (lf_packed(mm.x)) {
            const float4 rc = lf_s_rec[u];
            const float mg = __uint_as_float(mm.y), mhi = __fsub_rn(1.0f, mg);
            const float eb = __uint_as_float(0x4B000000u | ((mm.x & 0xFFFFu) >> 7));
            u32 c[4], slow = 0u;
#pragma unroll
            for (int i = 0; i < 4; i++) {
                u32 s;
                c[i] = lf_code_fast(rc, mg, mhi, eb, bf(i) & 0x7FFFu, s);
                slow |= s << i;
            }
            if (__any_sync(0xffffffffu, slow != 0u)) {
#pragma unroll
                for (int i = 0; i < 4; i++)
                    if ((slow >> i) & 1u) c[i] = lf_search(mm.x, bf(i) & 0x7FFFu, c[i]);
            }
            u64 bits = 0ull;
#pragma unroll
            for (int i = 0; i < 4; i++) bits |= (u64)(((bf(i) >> 15) << 9) | c[i]) << (10 * i);
            const u32 w0 = lf_body_word(bits, lane);
            const u32 w1 = lf_body_word(bits, lane + 32);
            *(u32*)(body + 4 * lane) = w0;
            if (lane < 8) *(u32*)(body + 128 + 4 * lane) = w1;
        } else {
            *(u32*)(body + 8 * lane) = v.x;
            *(u32*)(body + 8 * lane + 4) = v.y;
        }
    }
    __syncthreads();
}

// The combine reduction of docs/contract.md over LogFMT rows (H a multiple of 128): for each
// token t and channel h, acc = 0; for k ascending over valid slots (sk[t*K+k] >= 0): acc =
// fma(w[t][k], value(row(t, k), h), acc); out = bf16_rne(acc), the value a packed field's
// magnitude with its sign (lf_magnitude) or a raw group's bf16. Row (t, k) is the encoded row
// at cbuf + (t*K + k) * crow, where its owner put it (both paths; LogFMT never reads in place
// nor through NCCL). The (token, group) pairs are split into equal runs, one per warp of the
// rank's blocks. Lane k < K keeps slot k's row, weight, meta word, grid and the offset of its
// body (at the start of a run, the sizes before it, counted by the whole warp from the meta
// words; then advanced group by group), and hands them to every lane by shuffles; lane j
// decodes channels 4j..4j+3, the loads of up to 8 slots issued before any is used. Stamps p14
// when warp 0's run is set up. Out of line (scalar arguments): one copy per module.
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
        meta = mine ? *(const u32*)(row + (u64)g * LF_META_BYTES) : 0u;
        u32 np = 0u;
        if (g > 0) {
            // Packed groups before g of each slot: lanes kS..kS+S-1 count slot k's, S = 32 / K.
            const int S = 32 / K, k = lane / S, s = lane - k * S;
            u32 cnt = 0u;
            if (k < K && sk[t * K + k] >= 0) {
                const u8* r = (const u8*)cbuf + ((u64)t * K + k) * crow;
#pragma unroll 4
                for (int j = s; j < g; j += S) cnt += lf_packed(*(const u32*)(r + (u64)j * LF_META_BYTES)) ? 1u : 0u;
            }
            for (int kk = 0; kk < K; kk++) {
                const u32 tot = __reduce_add_sync(0xffffffffu, k == kk ? cnt : 0u);
                if (lane == kk) np = tot;
            }
        }
        my_at = (u32)G * LF_META_BYTES + np * LF_PACKED_BYTES + ((u32)g - np) * LF_RAW_BYTES;
    };
    token();
    if (warp == 0) lf_stamp(prof, 14);
    for (u64 pp = p0; pp < p1; pp++) {
        const bool pk = lf_packed(meta);
        LfGrid gr;
        gr.la = 0.0f;
        gr.step = 0.0f;
        if (pk) gr = lf_grid(meta);
        const u64 body = (u64)row + my_at;
        const u32 flags = (mine ? 1u : 0u) | (pk ? 2u : 0u);
        // The next pair's meta word, in flight during this one (same token only).
        const bool same = g + 1 < G && pp + 1 < p1;
        const u32 meta_next = same && mine ? *(const u32*)(row + (u64)(g + 1) * LF_META_BYTES) : 0u;
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int k0 = 0; k0 < K; k0 += 8) {
            u32 d0[8], d1[8], fl[8];
#pragma unroll
            for (int q = 0; q < 8; q++) {
                const int k = k0 + q;
                fl[q] = __shfl_sync(0xffffffffu, flags, k & 31);
                const u64 b = __shfl_sync(0xffffffffu, body, k & 31);
                if (k >= K) fl[q] = 0u;
                d0[q] = 0u;
                d1[q] = 0u;
                if (fl[q] & 1u) {
                    // Packed: bytes 5 lane .. 5 lane + 4 (from the 4-aligned word below); raw: 8 lane ..
                    const u32* w = (const u32*)(b + ((fl[q] & 2u) ? (u32)((5 * lane) & ~3) : (u32)(8 * lane)));
                    d0[q] = w[0];
                    d1[q] = w[1];
                }
            }
#pragma unroll
            for (int q = 0; q < 8; q++) {
                const int k = k0 + q;
                LfGrid gk;
                gk.la = __shfl_sync(0xffffffffu, gr.la, k & 31);
                gk.step = __shfl_sync(0xffffffffu, gr.step, k & 31);
                const float w = __shfl_sync(0xffffffffu, my_w, k & 31);
                if (!(fl[q] & 1u)) continue;
                float v[4];
                if (fl[q] & 2u) {
                    const u64 bits = (((u64)d1[q] << 32) | (u64)d0[q]) >> (8 * ((5 * lane) & 3));
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        const u32 f = (u32)(bits >> (10 * i)) & 0x3FFu;
                        v[i] = __uint_as_float(__float_as_uint(lf_magnitude(gk, f & LF_TOP_CODE)) | ((f & 0x200u) << 22));
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
