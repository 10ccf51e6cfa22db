// The per-token operations of a Llama layer. The residual stream `x` stays f32; whatever
// feeds a matrix multiply is written as f16 (cuBLAS reads f16, accumulates in f32).

// x[t] = embedding row ids[t]. One block per token.
extern "C" __global__ void embed_rows(const half_t* table, const u32* ids, float* x, int hidden) {
    int t = blockIdx.x;
    const half_t* row = table + (long long)ids[t] * hidden;
    float* out = x + (long long)t * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) out[i] = h2f(row[i]);
}

// out[r] = RMSNorm(x[rows[r]]) * w, as f16. One block per output row.
extern "C" __global__ void rms_norm_rows(const float* x, const int* rows, const float* w,
                                         half_t* out, int d, float eps) {
    __shared__ float red[32];
    const float* xr = x + (long long)rows[blockIdx.x] * d;
    float s = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) s += xr[i] * xr[i];
    s = block_sum(s, red);
    float scale = rsqrtf(s / (float)d + eps);
    half_t* o = out + (long long)blockIdx.x * d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) o[i] = f2h(xr[i] * scale * w[i]);
}

// Rotary embedding, GGML's "normal" layout (adjacent pairs), on the first `dims` values of
// every query and key head of token blockIdx.x. `qkv` rows hold q (heads × hd), then k, then v.
extern "C" __global__ void rope_qk(float* qkv, const int* pos, const float* inv_freq, int heads,
                                   int kv_heads, int hd, int dims, int stride) {
    int t = blockIdx.x;
    float p = (float)pos[t];
    float* row = qkv + (long long)t * stride;
    int pairs = dims / 2;
    int total = (heads + kv_heads) * pairs;
    for (int i = threadIdx.x; i < total; i += blockDim.x) {
        int h = i / pairs, j = i % pairs;
        float* x = row + h * hd + 2 * j;  // k heads follow the q heads directly
        float s, c;
        sincosf(p * inv_freq[j], &s, &c);
        float x0 = x[0], x1 = x[1];
        x[0] = x0 * c - x1 * s;
        x[1] = x0 * s + x1 * c;
    }
}

// Writes token blockIdx.x's keys and values into its cache slot (`slots[t]` = block ×
// block_size + offset). Cache layout per layer: [block][kv_head][slot][head_dim], f16.
extern "C" __global__ void kv_write(const float* qkv, const int* slots, half_t* kc, half_t* vc,
                                    int kv_heads, int hd, int bs, int stride, int k_off,
                                    int v_off) {
    int t = blockIdx.x;
    int slot = slots[t];
    long long block = slot / bs, s = slot % bs;
    const float* row = qkv + (long long)t * stride;
    for (int i = threadIdx.x; i < kv_heads * hd; i += blockDim.x) {
        int h = i / hd, d = i % hd;
        long long at = ((block * kv_heads + h) * bs + s) * hd + d;
        kc[at] = f2h(row[k_off + i]);
        vc[at] = f2h(row[v_off + i]);
    }
}

// act[t][j] = silu(gate) * up, from rows holding gate (inter values) then up (inter values).
extern "C" __global__ void silu_mul(const float* gu, half_t* act, int inter, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n * inter;
         i += (long long)gridDim.x * blockDim.x) {
        long long t = i / inter, j = i % inter;
        float g = gu[t * 2 * inter + j], u = gu[t * 2 * inter + inter + j];
        act[i] = f2h(g / (1.0f + expf(-g)) * u);
    }
}
