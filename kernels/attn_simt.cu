// CUDA-core flash attention: every dtype, every layout and mask, any head dim d % 8 == 0 up to
// DMAX. The f32 path, and the reference the tensor-core kernel is checked against.
//
// A CTA owns SIMT_BM queries of one head. 128 threads: 4 per query row; each computes 8 of the
// SIMT_BN scores of a key tile and owns every 4th output column. K/V tiles go through shared
// memory as f32, rows padded by one word so the row-strided reads hit distinct banks.
//
// Macros: ATTN_DTYPE, DMAX (32, 64, 128 or 256: the accumulator length is DMAX / 4).

#define SIMT_BM 32
#define SIMT_BN 32
#define SIMT_NT 128

extern "C" __global__ void __launch_bounds__(SIMT_NT) attn_simt(const AttnParams p) {
    extern __shared__ float smem[];
    const int d = p.d;
    const int ds = d + 1;
    float* Qs = smem;                   // [BM][ds]
    float* Ks = Qs + SIMT_BM * ds;      // [BN][ds]
    float* Vs = Ks + SIMT_BN * ds;      // [BN][ds]
    float* Ps = Vs + SIMT_BN * ds;      // [BM][BN + 1]
    __shared__ int s_lo, s_hi;

    const int b = blockIdx.z, h = blockIdx.y;
    const SeqInfo s = seq_info(p, b);
    const int m0 = blockIdx.x * SIMT_BM;
    if (m0 >= s.q_len) return;
    const int kvh = h / p.group;
    const int tid = threadIdx.x, r = tid >> 2, quarter = tid & 3;
    const int i = m0 + r;
    const bool row_ok = i < s.q_len;
    int lo = 0, hi = 0;
    if (row_ok) key_range(p, s, i, lo, hi);
    if (tid == 0) {
        s_lo = ATTN_INT_MAX;
        s_hi = 0;
    }
    __syncthreads();
    if (quarter == 0 && hi > lo) {
        atomicMin(&s_lo, lo);
        atomicMax(&s_hi, hi);
    }
    const elem_t* qg = (const elem_t*)p.q;
    const elem_t* kg = (const elem_t*)p.k;
    const elem_t* vg = (const elem_t*)p.v;
    for (int idx = tid; idx < SIMT_BM * d; idx += SIMT_NT) {
        int rr = idx / d, c = idx - rr * d;
        int ii = m0 + rr;
        Qs[rr * ds + c] = ii < s.q_len ? to_f(qg[(i64)(s.q_start + ii) * p.q_stride + (i64)h * d + c]) : 0.f;
    }
    __syncthreads();
    const int klo = s_lo, khi = s_hi;
    const float slope = p.alibi ? p.alibi[h] : 0.f;
    const int ia = i + s.k_len - s.q_len;
    const bool post = p.softcap > 0.f || slope != 0.f;
    float m = -ATTN_INF, l = 0.f;
    float acc[DMAX / 4];
#pragma unroll
    for (int c = 0; c < DMAX / 4; ++c) acc[c] = 0.f;

    if (klo < khi) {
        for (int n0 = (klo / SIMT_BN) * SIMT_BN; n0 < khi; n0 += SIMT_BN) {
            __syncthreads();
            for (int idx = tid; idx < SIMT_BN * d; idx += SIMT_NT) {
                int jj = idx / d, c = idx - jj * d;
                int t = n0 + jj;
                float kv = 0.f, vv = 0.f;
                if (t < s.k_len) {
                    i64 off = kv_row(p, b, s, t) * p.kv_stride + (i64)kvh * d + c;
                    kv = to_f(kg[off]);
                    vv = to_f(vg[off]);
                }
                Ks[jj * ds + c] = kv;
                Vs[jj * ds + c] = vv;
            }
            __syncthreads();
            float sc[SIMT_BN / 4];
            float tmax = -ATTN_INF;
#pragma unroll
            for (int c8 = 0; c8 < SIMT_BN / 4; ++c8) {
                const int jj = quarter + 4 * c8;
                const int j = n0 + jj;
                const float* qr = Qs + r * ds;
                const float* kr = Ks + jj * ds;
                float dot = 0.f;
                for (int kk = 0; kk < d; ++kk) dot = fmaf(qr[kk], kr[kk], dot);
                float sv = dot * p.scale;
                if (post) sv = score_post(p, sv, slope, ia, j);
                const bool vis = row_ok && j >= lo && j < hi;
                sc[c8] = vis ? sv * ATTN_LOG2E : -ATTN_INF;
                tmax = fmaxf(tmax, sc[c8]);
            }
            tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 1));
            tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 2));
            const float m_new = fmaxf(m, tmax);
            const float m_use = m_new == -ATTN_INF ? 0.f : m_new;
            const float alpha = exp2f(m - m_use);
            float psum = 0.f;
#pragma unroll
            for (int c8 = 0; c8 < SIMT_BN / 4; ++c8) {
                const float pv = exp2f(sc[c8] - m_use);
                Ps[r * (SIMT_BN + 1) + quarter + 4 * c8] = pv;
                psum += pv;
            }
            psum += __shfl_xor_sync(0xffffffffu, psum, 1);
            psum += __shfl_xor_sync(0xffffffffu, psum, 2);
            l = l * alpha + psum;
            m = m_new;
#pragma unroll
            for (int c = 0; c < DMAX / 4; ++c) acc[c] *= alpha;
            __syncwarp();
            for (int jj = 0; jj < SIMT_BN; ++jj) {
                const float pv = Ps[r * (SIMT_BN + 1) + jj];
                const float* vr = Vs + jj * ds;
#pragma unroll
                for (int c = 0; c < DMAX / 4; ++c) {
                    const int col = quarter + 4 * c;
                    if (col < d) acc[c] = fmaf(pv, vr[col], acc[c]);
                }
            }
        }
    }
    if (row_ok) {
        const float inv = l > 0.f ? 1.f / l : 0.f;
        elem_t* og = (elem_t*)p.o + (i64)(s.q_start + i) * p.q_stride + (i64)h * d;
#pragma unroll
        for (int c = 0; c < DMAX / 4; ++c) {
            const int col = quarter + 4 * c;
            if (col < d) og[col] = from_f(acc[c] * inv);
        }
        if (p.lse && quarter == 0) p.lse[lse_index(p, b, s, h, i)] = l > 0.f ? (m + log2f(l)) * ATTN_LN2 : -ATTN_INF;
    }
}
