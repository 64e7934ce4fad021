// The kernels of the moe_layer example (compiled at run time with NVRTC, FMA contraction off).
// One thread per token: the K largest scores (ties: the lower expert id first), weights = the
// chosen scores over their sum (summed in slot order).
extern "C" __global__ void moe_topk(const float* scores, int n, int E, int K,
                                    long long* idx, float* w) {
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n) return;
    const float* s = scores + (long long)t * E;
    long long* ti = idx + (long long)t * K;
    float* tw = w + (long long)t * K;
    float sum = 0.0f;
    for (int k = 0; k < K; ++k) {
        int best = -1;
        for (int e = 0; e < E; ++e) {
            bool taken = false;
            for (int j = 0; j < k; ++j) taken |= (ti[j] == e);
            if (!taken && (best < 0 || s[e] > s[best])) best = e;
        }
        ti[k] = best;
        sum += s[best];
    }
    for (int k = 0; k < K; ++k) tw[k] = s[ti[k]] / sum;
}

__device__ float pow2i(int e) {
    if (e > 127) return __int_as_float(0x7f800000);
    if (e >= -126) return __uint_as_float((unsigned)(e + 127) << 23);
    if (e >= -149) return __uint_as_float(1u << (e + 149));
    return 0.0f;
}

__device__ float e4m3(unsigned char q) {
    float sign = (q & 0x80) ? -1.0f : 1.0f;
    int ex = (q >> 3) & 0xF;
    float man = (float)(q & 7);
    if ((q & 0x7F) == 0x7F) return __int_as_float(0x7fc00000);
    if (ex == 0) return sign * man * pow2i(-9);
    return sign * (1.0f + man / 8.0f) * pow2i(ex - 7);
}

__device__ unsigned short to_bf16(float v) {
    unsigned u = __float_as_uint(v);
    if (v != v) return 0x7FFF;
    return (unsigned short)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

// One block per row of the dispatch layout [L, R*T, H]: the expert's output row is the
// dequantized received row times (0.5 + 0.25 * (global expert % 4)); rows past the expert's
// count are zero. mode: 0 bf16, 1 FP8 with f32 scales, 2 FP8 with UE8M0-packed scales.
extern "C" __global__ void moe_expert(const unsigned char* recv_x, const unsigned char* scales,
                                      const int* count, int rows_per_expert, int H, int mode,
                                      int scales_per_row, int expert_base, unsigned short* y) {
    long long row = blockIdx.x;
    int l = (int)(row / rows_per_expert);
    int i = (int)(row % rows_per_expert);
    bool live = i < count[l];
    float f = 0.5f + 0.25f * (float)((expert_base + l) % 4);
    unsigned short* yr = y + row * H;
    for (int j = threadIdx.x; j < H; j += blockDim.x) {
        unsigned short o = 0;
        if (live) {
            float v;
            if (mode == 0) {
                unsigned short b = ((const unsigned short*)recv_x)[row * H + j];
                v = __uint_as_float((unsigned)b << 16);
            } else {
                float sc;
                if (mode == 1) {
                    sc = ((const float*)scales)[row * scales_per_row + j / 128];
                } else {
                    int word = ((const int*)scales)[row * scales_per_row + j / 512];
                    sc = pow2i((int)((word >> (8 * ((j / 128) % 4))) & 0xFF) - 127);
                }
                v = e4m3(recv_x[row * H + j]) * sc;
            }
            o = to_bf16(v * f);
        }
        yr[j] = o;
    }
}
