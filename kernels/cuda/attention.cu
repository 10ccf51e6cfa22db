// Paged attention over the block manager's KV blocks, one kernel for prefill chunks and decodes.
//
// A tile is up to ATT_MAX_ROWS / group consecutive tokens of one sequence; a thread block takes
// one (tile, KV head, context partition). It stages ATT_CHUNK cached positions of that head's
// keys and values in shared memory at a time, and each of its warps updates the online softmax
// of its (token, query head) rows: lane i scores position i of the chunk, then every lane
// accumulates the values of its head_dim / 32 output dimensions. The `group` query heads that
// share a KV head read each staged block once (GQA). A row attends to the positions before and
// at its own (causal); new tokens' keys and values were written to the cache before this runs,
// so a chunk attends to itself and to everything cached before it, as on the CPU.
//
// With one partition the block writes the normalised result as f16. With several (long
// contexts and few tiles: decode), each writes its running max, sum and unnormalised
// accumulator, and `attention_combine` merges them.
//
// ATT_THREADS, ATT_WARPS, ATT_CHUNK, ATT_MAX_ROWS and ATT_MAX_HD are defined by the host
// (kernels/src/cuda_program.rs), which sizes the launch from the same numbers.

extern "C" __global__ void __launch_bounds__(ATT_THREADS) paged_attention(
    const float* qkv, int stride, const half_t* kc, const half_t* vc, const int* tiles,
    const int* table_off, const u32* tables, half_t* out, float* part_acc, float* part_ml,
    int n_tokens, int heads, int kv_heads, int hd, int bs, int part_len, float scale) {
    extern __shared__ float smem[];
    const int tile = blockIdx.x, kvh = blockIdx.y, part = blockIdx.z, parts = gridDim.z;
    const int group = heads / kv_heads;
    const int seq = tiles[4 * tile], t0 = tiles[4 * tile + 1], n_tok = tiles[4 * tile + 2],
              first_pos = tiles[4 * tile + 3];
    const int rows = n_tok * group;
    const int hw = hd / 2;  // 32-bit words (two f16 values) per head vector
    float* qs = smem;                                  // ATT_MAX_ROWS × hd
    float* acc = qs + ATT_MAX_ROWS * ATT_MAX_HD;       // ATT_MAX_ROWS × hd
    float* ml = acc + ATT_MAX_ROWS * ATT_MAX_HD;       // ATT_MAX_ROWS × (max, sum)
    u32* ks = (u32*)(ml + 2 * ATT_MAX_ROWS);           // ATT_CHUNK × (hw + 1): padded rows
    u32* vs = ks + ATT_CHUNK * (ATT_MAX_HD / 2 + 1);   // ATT_CHUNK × hw
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int max_ctx = first_pos + n_tok;
    const int p0 = part * part_len;
    const int p1 = min(p0 + part_len, max_ctx);
    const u32* table = tables + table_off[seq];

    for (int r = warp; r < rows; r += ATT_WARPS) {
        const int t = t0 + r / group, qh = kvh * group + r % group;
        const float* q = qkv + (long long)t * stride + qh * hd;
        for (int d = lane; d < hd; d += 32) {
            qs[r * hd + d] = q[d] * scale;
            acc[r * hd + d] = 0.0f;
        }
        if (lane == 0) {
            ml[2 * r] = NEG_INF;
            ml[2 * r + 1] = 0.0f;
        }
    }
    __syncwarp();

    for (int c0 = p0; c0 < p1; c0 += ATT_CHUNK) {
        const int n_pos = min(ATT_CHUNK, p1 - c0);
        __syncthreads();  // nobody still reads the previous chunk
        for (int w = threadIdx.x; w < n_pos * hw; w += ATT_THREADS) {
            const int p = w / hw, e = w - p * hw;
            const int pos = c0 + p;
            const long long block = table[pos / bs];
            const long long at = ((block * kv_heads + kvh) * bs + pos % bs) * hd;
            ks[p * (hw + 1) + e] = ((const u32*)(kc + at))[e];
            vs[p * hw + e] = ((const u32*)(vc + at))[e];
        }
        __syncthreads();
        for (int r = warp; r < rows; r += ATT_WARPS) {
            const int limit = first_pos + r / group + 1;  // positions < limit are visible
            const int pos = c0 + lane;
            const bool valid = lane < n_pos && pos < limit;
            float s = NEG_INF;
            if (valid) {
                const float* q = qs + r * hd;
                const u32* k = ks + lane * (hw + 1);
                float a = 0.0f;
                for (int e = 0; e < hw; e++) {
                    const u32 kk = k[e];
                    a += q[2 * e] * h2f((half_t)(kk & 0xffffu)) +
                         q[2 * e + 1] * h2f((half_t)(kk >> 16));
                }
                s = a;
            }
            const float m_chunk = warp_max(s);
            if (m_chunk == NEG_INF) continue;  // the same for every lane
            const float m_old = ml[2 * r];
            const float m_new = fmaxf(m_old, m_chunk);
            const float pr = valid ? expf(s - m_new) : 0.0f;
            const float corr = expf(m_old - m_new);  // 0 while nothing was seen
            const float l_chunk = warp_sum(pr);
            const int nd = hd / 32;
            float o[ATT_MAX_HD / 32];
#pragma unroll
            for (int j = 0; j < ATT_MAX_HD / 32; j++)
                o[j] = j < nd ? acc[r * hd + lane + 32 * j] * corr : 0.0f;
            for (int p = 0; p < n_pos; p++) {
                const float pp = __shfl_sync(0xffffffffu, pr, p);
                if (pp == 0.0f) continue;  // the same for every lane
                const half_t* v = (const half_t*)(vs + p * hw);
#pragma unroll
                for (int j = 0; j < ATT_MAX_HD / 32; j++)
                    if (j < nd) o[j] += pp * h2f(v[lane + 32 * j]);
            }
#pragma unroll
            for (int j = 0; j < ATT_MAX_HD / 32; j++)
                if (j < nd) acc[r * hd + lane + 32 * j] = o[j];
            __syncwarp();  // every lane has read ml[] before lane 0 updates it
            if (lane == 0) {
                ml[2 * r] = m_new;
                ml[2 * r + 1] = ml[2 * r + 1] * corr + l_chunk;
            }
            __syncwarp();
        }
    }

    for (int r = warp; r < rows; r += ATT_WARPS) {
        const int t = t0 + r / group, qh = kvh * group + r % group;
        const float m = ml[2 * r], l = ml[2 * r + 1];
        if (parts == 1) {
            const float inv = l > 0.0f ? 1.0f / l : 0.0f;
            half_t* o = out + (long long)t * heads * hd + qh * hd;
            for (int d = lane; d < hd; d += 32) o[d] = f2h(acc[r * hd + d] * inv);
        } else {
            const long long row = ((long long)part * n_tokens + t) * heads + qh;
            for (int d = lane; d < hd; d += 32) part_acc[row * hd + d] = acc[r * hd + d];
            if (lane == 0) {
                part_ml[2 * row] = m;
                part_ml[2 * row + 1] = l;
            }
        }
    }
}

// Merges the partitions of each (token, query head): one block per pair.
extern "C" __global__ void attention_combine(const float* part_acc, const float* part_ml,
                                             half_t* out, int parts, int n_tokens, int heads,
                                             int hd) {
    const int t = blockIdx.x, h = blockIdx.y;
    float mx = NEG_INF;
    for (int p = 0; p < parts; p++) {
        const long long row = ((long long)p * n_tokens + t) * heads + h;
        if (part_ml[2 * row + 1] > 0.0f) mx = fmaxf(mx, part_ml[2 * row]);
    }
    float total = 0.0f;
    for (int p = 0; p < parts; p++) {
        const long long row = ((long long)p * n_tokens + t) * heads + h;
        const float l = part_ml[2 * row + 1];
        if (l > 0.0f) total += l * expf(part_ml[2 * row] - mx);
    }
    const float inv = total > 0.0f ? 1.0f / total : 0.0f;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float a = 0.0f;
        for (int p = 0; p < parts; p++) {
            const long long row = ((long long)p * n_tokens + t) * heads + h;
            const float l = part_ml[2 * row + 1];
            if (l > 0.0f) a += part_acc[row * hd + d] * expf(part_ml[2 * row] - mx);
        }
        out[((long long)t * heads + h) * hd + d] = f2h(a * inv);
    }
}
