// Split-KV combine, appended to the decode and tensor-core kernel sources: both write partial
// outputs (f32, [split][total_q][hq][d], each normalised by its own sum) and their lse (natural
// log, -inf for an empty share) into the workspace, and this kernel merges them into `o`/`lse`.

// Merge split-KV partials: one CTA of 8 warps per (token, head). Warp 0 finds the merged lse;
// then warp w takes splits w, w + 8, ..., its lanes the columns, so a long decode split many
// ways (up to 128 shares) keeps 8 warps' loads in flight instead of one warp's chain; the warps'
// sums meet in shared memory.
#define COMB_WARPS 8
extern "C" __global__ void __launch_bounds__(COMB_WARPS * 32) attn_combine(const AttnParams p) {
    __shared__ float red[COMB_WARPS][256];
    __shared__ float s_lse;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const i64 row = blockIdx.x;
    if (row >= (i64)p.total_q * p.hq) return;  // the whole CTA
    const int tok = (int)(row / p.hq), h = (int)(row % p.hq);
    const int d = p.d, ns = p.num_splits;
    const i64 plane = (i64)p.total_q * p.hq;
    if (warp == 0) {
        float mx = -ATTN_INF;
        for (int sp = lane; sp < ns; sp += 32) mx = fmaxf(mx, p.lse_part[sp * plane + row]);
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
        float sum = 0.f;
        if (mx != -ATTN_INF) {
            for (int sp = lane; sp < ns; sp += 32) sum += expf(p.lse_part[sp * plane + row] - mx);
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
        const float lse = sum > 0.f ? mx + logf(sum) : -ATTN_INF;
        if (lane == 0) {
            s_lse = lse;
            if (p.lse) {
                i64 li;
                if (p.layout == 0) {
                    const int bb = tok / p.dense_sq, i = tok % p.dense_sq;
                    li = ((i64)bb * p.hq + h) * p.dense_sq + i;
                } else {
                    li = (i64)h * p.total_q + tok;
                }
                p.lse[li] = lse;
            }
        }
    }
    __syncthreads();
    const float lse = s_lse;
    // An empty row (every share -inf) writes zeros; otherwise an empty share weighs exp(-inf) = 0
    // and holds zeros.
    float acc[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) acc[k] = 0.f;
    if (lse != -ATTN_INF) {
        for (int sp = warp; sp < ns; sp += COMB_WARPS) {
            const i64 at = sp * plane + row;
            const float w = expf(p.lse_part[at] - lse);
            const float* op = p.o_part + at * d;
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                const int c = lane + 32 * k;
                if (c < d) acc[k] += w * op[c];
            }
        }
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        const int c = lane + 32 * k;
        if (c < d) red[warp][c] = acc[k];
    }
    __syncthreads();
    elem_t* og = (elem_t*)p.o + (i64)tok * p.q_stride + (i64)h * d;
    for (int c = threadIdx.x; c < d; c += COMB_WARPS * 32) {
        float o = 0.f;
#pragma unroll
        for (int w = 0; w < COMB_WARPS; ++w) o += red[w][c];
        og[c] = from_f(o);
    }
}
