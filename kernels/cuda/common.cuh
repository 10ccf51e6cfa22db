// Shared by every kvgate kernel. NVRTC compiles these sources with no headers at all (no
// cuda_fp16.h, no stdint.h), so half-precision values are carried as their 16-bit patterns and
// converted with the PTX instructions the hardware has.

typedef unsigned short half_t;
typedef unsigned int u32;
typedef unsigned char u8;

#define NEG_INF (__int_as_float(0xff800000))

__device__ __forceinline__ float h2f(half_t h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ half_t f2h(float f) {
    half_t h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the whole block (blockDim.x a multiple of 32); every thread gets the total.
// `smem` holds 32 floats; the leading barrier makes the helper safe to call repeatedly.
__device__ float block_sum(float v, float* smem) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) smem[warp] = v;
    __syncthreads();
    v = lane < nw ? smem[lane] : 0.0f;
    return warp_sum(v);
}

__device__ float block_max(float v, float* smem) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) smem[warp] = v;
    __syncthreads();
    v = lane < nw ? smem[lane] : NEG_INF;
    return warp_max(v);
}
