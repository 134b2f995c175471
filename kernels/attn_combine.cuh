// Split-KV combine, appended to the decode and tensor-core kernel sources: both write partial
// outputs (f32, [split][total_q][hq][d], each normalised by its own sum) and their lse (natural
// log, -inf for an empty share) into the workspace, and this kernel merges them into `o`/`lse`.

// Merge split-KV partials: one warp per (token, head).
extern "C" __global__ void __launch_bounds__(128) attn_combine(const AttnParams p) {
    const int lane = threadIdx.x & 31;
    const i64 row = (i64)blockIdx.x * 4 + (threadIdx.x >> 5);
    if (row >= (i64)p.total_q * p.hq) return;
    const int tok = (int)(row / p.hq), h = (int)(row % p.hq);
    const int d = p.d;
    const i64 plane = (i64)p.total_q * p.hq;
    float mx = -ATTN_INF;
    for (int sp = lane; sp < p.num_splits; sp += 32) mx = fmaxf(mx, p.lse_part[sp * plane + row]);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    float sum = 0.f;
    if (mx != -ATTN_INF) {
        for (int sp = lane; sp < p.num_splits; sp += 32) sum += expf(p.lse_part[sp * plane + row] - mx);
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    const float lse = sum > 0.f ? mx + logf(sum) : -ATTN_INF;
    elem_t* og = (elem_t*)p.o + (i64)tok * p.q_stride + (i64)h * d;
    for (int c = lane; c < d; c += 32) {
        float o = 0.f;
        if (sum > 0.f) {
            for (int sp = 0; sp < p.num_splits; ++sp) {
                const float w = expf(p.lse_part[sp * plane + row] - lse);
                o += w * p.o_part[(sp * plane + row) * d + c];
            }
        }
        og[c] = from_f(o);
    }
    if (p.lse && lane == 0) {
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
