// fp8.cuh: the FP8 cast of docs/contract.md, bit-identical to ep_reference::numerics::fp8.
// A warp quantizes 256 channels per step: lanes 0-15 one group of 128, lanes 16-31 the next;
// each lane holds 8 channels (one 16-byte load of bf16).

__device__ __forceinline__ float pow2i(int e) {
    if (e > 127) return __uint_as_float(0x7F800000u);
    if (e >= -126) return __uint_as_float(((u32)(e + 127)) << 23);
    if (e >= -149) return __uint_as_float(1u << (e + 149));
    return 0.0f;
}
__device__ __forceinline__ int ceil_log2_bits(float v) {
    u32 b = __float_as_uint(v);
    int e = (int)((b >> 23) & 0xFFu) - 127;
    return e + ((b & 0x7FFFFFu) != 0u ? 1 : 0);
}
// Two values to e4m3 (satfinite, round to nearest even); lo lands in the low byte.
__device__ __forceinline__ u32 e4m3x2(float lo, float hi) {
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return (u32)r;
}

struct Quant8 {
    uint2 q;          // 8 e4m3 bytes
    float scale_inv;  // of this lane's group
};

// v: 8 bf16 of this lane; all 32 lanes must call (lanes whose group is out of range pass zeros
// and ignore the result). The amax is reduced over the 16 lanes of this lane's half-warp.
__device__ __forceinline__ Quant8 quantize8(uint4 v, int round_scale) {
    float f[8];
    const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        f[2 * i] = __uint_as_float(w[i] << 16);
        f[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
    }
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; i++) amax = fmaxf(amax, fabsf(f[i]));
#pragma unroll
    for (int o = 8; o >= 1; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    amax = fmaxf(1e-4f, amax);
    float scale, scale_inv;
    if (round_scale) {
        int e = ceil_log2_bits(amax * (1.0f / 448.0f));
        scale_inv = pow2i(e);
        scale = pow2i(-e);
    } else {
        scale_inv = amax * (1.0f / 448.0f);
        scale = 448.0f / amax;
    }
    Quant8 r;
    r.q.x = e4m3x2(f[0] * scale, f[1] * scale) | (e4m3x2(f[2] * scale, f[3] * scale) << 16);
    r.q.y = e4m3x2(f[4] * scale, f[5] * scale) | (e4m3x2(f[6] * scale, f[7] * scale) << 16);
    r.scale_inv = scale_inv;
    return r;
}

__device__ __forceinline__ u32 ue8m0_byte(float scale_inv) { return (__float_as_uint(scale_inv) >> 23) & 0xFFu; }

// One warp's share of one row: channels [c0, c0 + 512), loaded (and for FP8 quantized) once,
// then stored to any number of destinations with seg_store.
struct Seg {
    uint4 v[2];       // bf16: the raw bits; fp8: .x/.y hold the 8 e4m3 bytes
    float si[2];      // fp8: scale_inv of this lane's group in each step
    u32 packed;       // ue8m0: the 4 exponent bytes of groups c0/128 .. c0/128+3
};

// The raw load of a segment (no use of the values yet: the loads stay in flight, so a caller can
// issue them early and quantize later with seg_quant).
__device__ __forceinline__ Seg seg_fetch(const KParams& p, const u16* x, int c0) {
    const int lane = threadIdx.x & 31;
    Seg s;
    s.packed = 0u;
#pragma unroll
    for (int i = 0; i < 2; i++) {
        int c = c0 + i * 256 + lane * 8;
        s.v[i] = (c < p.H && (p.H & 7) == 0) ? *(const uint4*)(x + c) : make_uint4(0u, 0u, 0u, 0u);
        s.si[i] = 0.0f;
    }
    return s;
}
// FP8 mode: quantizes a fetched segment in place (all 32 lanes); BF16: nothing to do.
__device__ __forceinline__ void seg_quant(const KParams& p, Seg& s) {
    if (p.fp8) {
#pragma unroll
        for (int i = 0; i < 2; i++) {
            Quant8 r = quantize8(s.v[i], p.round_scale);
            s.v[i] = make_uint4(r.q.x, r.q.y, 0u, 0u);
            s.si[i] = r.scale_inv;
        }
        if (p.ue8m0) {
            u32 b00 = ue8m0_byte(__shfl_sync(0xffffffffu, s.si[0], 0));
            u32 b01 = ue8m0_byte(__shfl_sync(0xffffffffu, s.si[0], 16));
            u32 b10 = ue8m0_byte(__shfl_sync(0xffffffffu, s.si[1], 0));
            u32 b11 = ue8m0_byte(__shfl_sync(0xffffffffu, s.si[1], 16));
            s.packed = b00 | (b01 << 8) | (b10 << 16) | (b11 << 24);
        }
    }
}
__device__ __forceinline__ Seg seg_load(const KParams& p, const u16* x, int c0) {
    Seg s = seg_fetch(p, x, c0);
    seg_quant(p, s);
    return s;
}

// Stores a loaded segment: the row's bytes at dst, its scales at dsts (the payload layout puts
// them at dst + xrow; the canonical layout in recv_scales).
// BF16 rows whose H is not a multiple of 8 are copied from x two bytes at a time.
__device__ __forceinline__ void seg_store_xs(const KParams& p, const Seg& s, const u16* x, int c0, u8* dst, ScaleRow dsts) {
    const int lane = threadIdx.x & 31;
    const int H = p.H;
    if (!p.fp8) {
        if ((H & 7) == 0) {
#pragma unroll
            for (int i = 0; i < 2; i++) {
                int c = c0 + i * 256 + lane * 8;
                if (c < H) *(uint4*)(dst + 2 * c) = s.v[i];
            }
        } else {
            for (int c = c0 + lane; c < c0 + 512 && c < H; c += 32) *(u16*)(dst + 2 * c) = x[c];
        }
        return;
    }
#pragma unroll
    for (int i = 0; i < 2; i++) {
        int c = c0 + i * 256 + lane * 8;
        if (c < H) {
            *(uint2*)(dst + c) = make_uint2(s.v[i].x, s.v[i].y);
            if (!p.ue8m0 && (lane & 15) == 0) *(float*)(dsts.p + (u64)(c >> 7) * dsts.step) = s.si[i];
        }
    }
    if (p.ue8m0 && lane == 0) dsts.p[(u64)(c0 >> 9) * dsts.step] = s.packed;
}
// Stores a loaded segment into the payload at dst (row bytes, then scales at dst + xrow).
__device__ __forceinline__ void seg_store(const KParams& p, const Seg& s, const u16* x, int c0, u8* dst) {
    seg_store_xs(p, s, x, c0, dst, ScaleRow{(u32*)(dst + p.xrow), 1});
}
