// Weights to f16 at load: GGML's 32-value blocks (Q4_0, Q4_1, Q8_0) and f32 (the dense
// matrices the loader already widened). One thread per block of 32 values; `dst` may point
// into a larger buffer (fused matrices are dequantised side by side).

__device__ __forceinline__ float le_f16(const u8* p) {
    return h2f((half_t)(p[0] | (p[1] << 8)));
}

extern "C" __global__ void dequant_q4_0(const u8* src, half_t* dst, long long blocks) {
    for (long long b = blockIdx.x * (long long)blockDim.x + threadIdx.x; b < blocks;
         b += (long long)gridDim.x * blockDim.x) {
        const u8* p = src + b * 18;
        float d = le_f16(p);
        half_t* o = dst + b * 32;
        for (int j = 0; j < 16; j++) {
            int q = p[2 + j];
            o[j] = f2h((float)((q & 15) - 8) * d);
            o[j + 16] = f2h((float)((q >> 4) - 8) * d);
        }
    }
}

extern "C" __global__ void dequant_q4_1(const u8* src, half_t* dst, long long blocks) {
    for (long long b = blockIdx.x * (long long)blockDim.x + threadIdx.x; b < blocks;
         b += (long long)gridDim.x * blockDim.x) {
        const u8* p = src + b * 20;
        float d = le_f16(p), m = le_f16(p + 2);
        half_t* o = dst + b * 32;
        for (int j = 0; j < 16; j++) {
            int q = p[4 + j];
            o[j] = f2h((float)(q & 15) * d + m);
            o[j + 16] = f2h((float)(q >> 4) * d + m);
        }
    }
}

extern "C" __global__ void dequant_q8_0(const u8* src, half_t* dst, long long blocks) {
    for (long long b = blockIdx.x * (long long)blockDim.x + threadIdx.x; b < blocks;
         b += (long long)gridDim.x * blockDim.x) {
        const u8* p = src + b * 34;
        float d = le_f16(p);
        half_t* o = dst + b * 32;
        for (int j = 0; j < 32; j++) o[j] = f2h((float)(signed char)p[2 + j] * d);
    }
}

extern "C" __global__ void f32_to_f16(const float* src, half_t* dst, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        dst[i] = f2h(src[i]);
}
