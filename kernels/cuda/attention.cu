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
// Loading a chunk: each thread loads 16-byte pieces of keys and values into registers (the
// host admits head sizes that are multiples of 32 only), and the next chunk's loads are issued
// before the current chunk is scored, so memory and arithmetic overlap: a chunk in flight per
// block rather than one 4-byte load per thread at a time.
//
// ATT_THREADS, ATT_WARPS, ATT_CHUNK, ATT_MAX_ROWS and ATT_MAX_HD are defined by the host
// (kernels/src/cuda_program.rs), which sizes the launch from the same numbers.

// 16-byte pieces of one chunk's keys (and as many of its values) each thread carries.
#define ATT_VEC_SLOTS ((ATT_CHUNK * ATT_MAX_HD / 8 + ATT_THREADS - 1) / ATT_THREADS)
// The values' staging area starts 16-byte aligned (uint4 stores).
static_assert((2 * ATT_MAX_ROWS * ATT_MAX_HD + 2 * ATT_MAX_ROWS +
               ATT_CHUNK * (ATT_MAX_HD / 2 + 1)) % 4 == 0,
              "the value staging area must be 16-byte aligned");

struct KvPieces {
    uint4 k[ATT_VEC_SLOTS];
    uint4 v[ATT_VEC_SLOTS];
};

// Issues this thread's loads of chunk [c0, c0 + n_pos) of head `kvh` (hq pieces per position).
__device__ __forceinline__ void att_load(KvPieces& r, const half_t* kc, const half_t* vc,
                                         const u32* table, int c0, int n_pos, int hq,
                                         int kv_heads, int kvh, int bs, int hd) {
#pragma unroll
    for (int u = 0; u < ATT_VEC_SLOTS; u++) {
        const int w = threadIdx.x + u * ATT_THREADS;
        if (w < n_pos * hq) {
            const int p = w / hq, e = w - p * hq;
            const int pos = c0 + p;
            const long long block = table[pos / bs];
            const long long at = ((block * kv_heads + kvh) * bs + pos % bs) * hd;
            r.k[u] = ((const uint4*)(kc + at))[e];
            r.v[u] = ((const uint4*)(vc + at))[e];
        }
    }
}

// Writes what att_load brought into the staging area (keys in padded rows, values dense).
__device__ __forceinline__ void att_store(const KvPieces& r, u32* ks, u32* vs, int n_pos,
                                          int hq, int hw) {
#pragma unroll
    for (int u = 0; u < ATT_VEC_SLOTS; u++) {
        const int w = threadIdx.x + u * ATT_THREADS;
        if (w < n_pos * hq) {
            const int p = w / hq, e = w - p * hq;
            u32* kd = ks + p * (hw + 1) + 4 * e;
            kd[0] = r.k[u].x;
            kd[1] = r.k[u].y;
            kd[2] = r.k[u].z;
            kd[3] = r.k[u].w;
            ((uint4*)(vs + p * hw))[e] = r.v[u];
        }
    }
}

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

    const int hq = hd / 8;  // 16-byte pieces per head vector (hd is a multiple of 32)
    KvPieces next;
    if (p0 < p1)
        att_load(next, kc, vc, table, p0, min(ATT_CHUNK, p1 - p0), hq, kv_heads, kvh, bs, hd);
    for (int c0 = p0; c0 < p1; c0 += ATT_CHUNK) {
        const int n_pos = min(ATT_CHUNK, p1 - c0);
        __syncthreads();  // nobody still reads the previous chunk
        att_store(next, ks, vs, n_pos, hq, hw);
        const int c1 = c0 + ATT_CHUNK;
        if (c1 < p1)  // in flight while this chunk is scored
            att_load(next, kc, vc, table, c1, min(ATT_CHUNK, p1 - c1), hq, kv_heads, kvh, bs, hd);
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
