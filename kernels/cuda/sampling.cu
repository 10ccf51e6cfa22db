// Choosing the next token on the device: greedy, or temperature with top-p. One block per
// sampled row; only the chosen token ids travel back to the host.

// The warp's largest (value, index), the lowest index among equals, in every lane.
__device__ __forceinline__ void warp_argmax(float& best, int& idx) {
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, best, o);
        const int oi = __shfl_xor_sync(0xffffffffu, idx, o);
        if (ov > best || (ov == best && oi < idx)) {
            best = ov;
            idx = oi;
        }
    }
}

// The index of the largest logit of each row, the lowest index among equals (as on the CPU).
extern "C" __global__ void argmax_rows(const float* logits, int vocab, u32* out) {
    __shared__ float best_v[32];
    __shared__ int best_i[32];
    const float* x = logits + (long long)blockIdx.x * vocab;
    float best = NEG_INF;
    int idx = 0x7fffffff;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float v = x[i];
        if (v > best) {
            best = v;
            idx = i;
        }
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    warp_argmax(best, idx);
    if (lane == 0) {
        best_v[warp] = best;
        best_i[warp] = idx;
    }
    __syncthreads();
    if (warp == 0) {
        best = lane < nw ? best_v[lane] : NEG_INF;
        idx = lane < nw ? best_i[lane] : 0x7fffffff;
        warp_argmax(best, idx);
        if (lane == 0) out[blockIdx.x] = idx == 0x7fffffff ? 0u : (u32)idx;
    }
}

// Temperature and top-p. `params` holds, per row, the temperature, top_p and a uniform draw in
// [0, 1) made on the host from the request's seed. The kept set is the most likely tokens whose
// probability reaches top_p (its logit threshold found by bisection); the token is the first, in
// id order, at which the kept probability accumulated passes the draw. Launch with
// SAMPLE_THREADS threads.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS) sample_top_p(
    const float* logits, int vocab, const float* params, u32* out) {
    __shared__ float red[32];
    __shared__ float prefix[SAMPLE_THREADS];
    __shared__ float kept_total;
    __shared__ int chosen, last_kept;
    const float* x = logits + (long long)blockIdx.x * vocab;
    const float inv_t = 1.0f / params[3 * blockIdx.x];
    const float top_p = params[3 * blockIdx.x + 1];
    const float u = params[3 * blockIdx.x + 2];

    // The extremes over finite logits (a masked -inf logit has weight 0 and is never kept).
    float mx = NEG_INF, mn = -NEG_INF;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float v = x[i];
        if (v > NEG_INF && v < -NEG_INF) {
            mx = fmaxf(mx, v);
            mn = fminf(mn, v);
        }
    }
    mx = block_max(mx, red);
    mn = -block_max(-mn, red);

    float cut = mn;
    if (top_p < 1.0f) {
        float total = 0.0f;
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) total += expf((x[i] - mx) * inv_t);
        total = block_sum(total, red);
        const float need = top_p * total;
        // mass(c): the weight of the tokens whose logit is at least c; it falls as c rises.
        float top = 0.0f;
        for (int i = threadIdx.x; i < vocab; i += blockDim.x)
            if (x[i] >= mx) top += 1.0f;
        top = block_sum(top, red);
        if (top >= need) {
            cut = mx;  // the most likely token(s) alone reach top_p
        } else {
            float lo = mn, hi = mx;  // mass(lo) >= need > mass(hi)
            for (int it = 0; it < 48; it++) {
                const float mid = 0.5f * (lo + hi);
                if (!(mid > lo && mid < hi)) break;  // the same for every thread
                float m = 0.0f;
                for (int i = threadIdx.x; i < vocab; i += blockDim.x)
                    if (x[i] >= mid) m += expf((x[i] - mx) * inv_t);
                m = block_sum(m, red);
                if (m >= need) lo = mid; else hi = mid;
            }
            cut = lo;
        }
    }

    const int per = (vocab + blockDim.x - 1) / blockDim.x;
    const int b0 = min((int)threadIdx.x * per, vocab), b1 = min(b0 + per, vocab);
    float mine = 0.0f;
    int my_last = -1;
    for (int i = b0; i < b1; i++)
        if (x[i] >= cut) {
            const float w = expf((x[i] - mx) * inv_t);
            if (w > 0.0f) {
                mine += w;
                my_last = i;
            }
        }
    prefix[threadIdx.x] = mine;
    if (threadIdx.x == 0) {
        chosen = 0x7fffffff;
        last_kept = 0;
    }
    __syncthreads();
    if (my_last >= 0) atomicMax(&last_kept, my_last);
    if (threadIdx.x == 0) {
        float c = 0.0f;
        for (int k = 0; k < (int)blockDim.x; k++) {
            const float s = prefix[k];
            prefix[k] = c;
            c += s;
        }
        kept_total = c;
    }
    __syncthreads();
    // The draw, kept strictly below the total (u × total can round up to it).
    const float target = fminf(u * kept_total, kept_total * 0.99999994f);
    const float before = prefix[threadIdx.x];
    if (mine > 0.0f && target >= before && target < before + mine) {
        // The walk repeats the sum that made `mine`, from zero, so it rounds the same way;
        // should it still end short, the range's last kept token is the one.
        const float local = target - before;
        float c = 0.0f;
        int pick = my_last;
        for (int i = b0; i < b1; i++)
            if (x[i] >= cut) {
                const float w = expf((x[i] - mx) * inv_t);
                if (w > 0.0f) {
                    c += w;
                    if (local < c) {
                        pick = i;
                        break;
                    }
                }
            }
        atomicMin(&chosen, pick);
    }
    __syncthreads();
    if (threadIdx.x == 0) out[blockIdx.x] = (u32)(chosen == 0x7fffffff ? last_kept : chosen);
}
