// Decode (flash-decoding): few query rows per kv head, many keys. Memory-bound, so CUDA cores.
//
// A CTA owns one kv head of one sequence and one split of its keys, and every query row that
// reads that kv head: rows r = i * group + hh (all queries i of the sequence, all heads hh of
// the GQA group), at most RMAX of them. So each K/V row is read once for the whole group.
// LPK lanes share one key (8 columns each); a warp holds 32 / LPK keys at a time and DEC_U key
// steps are loaded before the first use, to keep enough bytes in flight.
// With num_splits > 1 it writes f32 partials and their lse; attn_combine merges them.
//
// Macros: ATTN_DTYPE, LPK (1, 2, 4, 8, 16 or 32; LPK * 8 >= d), RMAX (1, 2, 4 or 8).

#define DEC_NW 4
#define DEC_U 4
#define KPW (32 / LPK)

struct Raw8 {
    uint4 a;
#if ATTN_DTYPE == 0
    uint4 b;
#endif
};

__device__ __forceinline__ Raw8 load8(const elem_t* ptr) {
    Raw8 r;
    r.a = *(const uint4*)ptr;
#if ATTN_DTYPE == 0
    r.b = *((const uint4*)ptr + 1);
#endif
    return r;
}
__device__ __forceinline__ Raw8 zero8() {
    Raw8 r;
    r.a = make_uint4(0, 0, 0, 0);
#if ATTN_DTYPE == 0
    r.b = make_uint4(0, 0, 0, 0);
#endif
    return r;
}
__device__ __forceinline__ void cvt8(const Raw8& r, float* f) {
#if ATTN_DTYPE == 0
    f[0] = __uint_as_float(r.a.x); f[1] = __uint_as_float(r.a.y);
    f[2] = __uint_as_float(r.a.z); f[3] = __uint_as_float(r.a.w);
    f[4] = __uint_as_float(r.b.x); f[5] = __uint_as_float(r.b.y);
    f[6] = __uint_as_float(r.b.z); f[7] = __uint_as_float(r.b.w);
#else
    const u32 w[4] = {r.a.x, r.a.y, r.a.z, r.a.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        f[2 * e] = to_f((u16)(w[e] & 0xffffu));
        f[2 * e + 1] = to_f((u16)(w[e] >> 16));
    }
#endif
}

extern "C" __global__ void __launch_bounds__(DEC_NW * 32) attn_decode(const AttnParams p) {
    __shared__ float sm_m[DEC_NW][RMAX];
    __shared__ float sm_l[DEC_NW][RMAX];
    __shared__ float sm_acc[DEC_NW][RMAX][LPK * 8];

    const int split = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
    const SeqInfo s = seq_info(p, b);
    const int R = s.q_len * p.group;
    if (R == 0) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int sub = lane % LPK, grp = lane / LPK;
    const int d = p.d;
    const int col0 = sub * 8;
    const bool col_ok = col0 < d;
    const elem_t* qg = (const elem_t*)p.q;
    const elem_t* kg = (const elem_t*)p.k;
    const elem_t* vg = (const elem_t*)p.v;

    float q[RMAX][8];
    int lo[RMAX], hi[RMAX], iar[RMAX];
    float slope[RMAX];
    int klo = ATTN_INT_MAX, khi = 0;
#pragma unroll
    for (int r = 0; r < RMAX; ++r) {
        lo[r] = 0;
        hi[r] = 0;
        iar[r] = 0;
        slope[r] = 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) q[r][e] = 0.f;
        if (r < R) {
            const int i = r / p.group, h = kvh * p.group + r % p.group;
            key_range(p, s, i, lo[r], hi[r]);
            iar[r] = i + s.k_len - s.q_len;
            slope[r] = p.alibi ? p.alibi[h] : 0.f;
            if (col_ok) {
                Raw8 raw = load8(qg + (i64)(s.q_start + i) * p.q_stride + (i64)h * d + col0);
                cvt8(raw, q[r]);
            }
            if (hi[r] > lo[r]) {
                klo = min(klo, lo[r]);
                khi = max(khi, hi[r]);
            }
        }
    }
    int start = 0, end = 0;
    if (klo < khi) {
        const int chunk = (khi - klo + p.num_splits - 1) / p.num_splits;
        start = klo + split * chunk;
        end = min(start + chunk, khi);
    }
    const bool post = p.softcap > 0.f || p.alibi != 0;

    float m[RMAX], l[RMAX], acc[RMAX][8];
#pragma unroll
    for (int r = 0; r < RMAX; ++r) {
        m[r] = -ATTN_INF;
        l[r] = 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[r][e] = 0.f;
    }

    const int step = DEC_NW * KPW * DEC_U;
    for (int t0 = start + warp * KPW * DEC_U; t0 < end; t0 += step) {
        Raw8 kr[DEC_U], vr[DEC_U];
#pragma unroll
        for (int u = 0; u < DEC_U; ++u) {
            const int t = t0 + u * KPW + grp;
            if (t < end && col_ok) {
                const i64 off = kv_row(p, b, s, t) * p.kv_stride + (i64)kvh * d + col0;
                kr[u] = load8(kg + off);
                vr[u] = load8(vg + off);
            } else {
                kr[u] = zero8();
                vr[u] = zero8();
            }
        }
        float sc[DEC_U][RMAX];
#pragma unroll
        for (int u = 0; u < DEC_U; ++u) {
            const int t = t0 + u * KPW + grp;
            float kf[8];
            cvt8(kr[u], kf);
#pragma unroll
            for (int r = 0; r < RMAX; ++r) {
                float dot = 0.f;
#pragma unroll
                for (int e = 0; e < 8; ++e) dot = fmaf(q[r][e], kf[e], dot);
#pragma unroll
                for (int off = LPK / 2; off > 0; off >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, off);
                float sv = dot * p.scale;
                if (post) sv = score_post(p, sv, slope[r], iar[r], t);
                const bool vis = r < R && t < end && t >= lo[r] && t < hi[r];
                sc[u][r] = vis ? sv * ATTN_LOG2E : -ATTN_INF;
            }
        }
#pragma unroll
        for (int r = 0; r < RMAX; ++r) {
            float mx = m[r];
#pragma unroll
            for (int u = 0; u < DEC_U; ++u) mx = fmaxf(mx, sc[u][r]);
            const float m_use = mx == -ATTN_INF ? 0.f : mx;
            const float alpha = exp2f(m[r] - m_use);
            l[r] *= alpha;
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[r][e] *= alpha;
            m[r] = mx;
        }
#pragma unroll
        for (int u = 0; u < DEC_U; ++u) {
            float vf[8];
            cvt8(vr[u], vf);
#pragma unroll
            for (int r = 0; r < RMAX; ++r) {
                const float m_use = m[r] == -ATTN_INF ? 0.f : m[r];
                const float pv = exp2f(sc[u][r] - m_use);
                l[r] += pv;
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[r][e] = fmaf(pv, vf[e], acc[r][e]);
            }
        }
    }

    // Merge the key groups of this warp (lanes with equal `sub` hold the same columns).
#pragma unroll
    for (int off = LPK; off < 32; off <<= 1) {
#pragma unroll
        for (int r = 0; r < RMAX; ++r) {
            const float mo = __shfl_xor_sync(0xffffffffu, m[r], off);
            const float lo_ = __shfl_xor_sync(0xffffffffu, l[r], off);
            const float mn = fmaxf(m[r], mo);
            const float mu = mn == -ATTN_INF ? 0.f : mn;
            const float a = exp2f(m[r] - mu), c = exp2f(mo - mu);
            l[r] = l[r] * a + lo_ * c;
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                const float ao = __shfl_xor_sync(0xffffffffu, acc[r][e], off);
                acc[r][e] = acc[r][e] * a + ao * c;
            }
            m[r] = mn;
        }
    }
    if (grp == 0) {
#pragma unroll
        for (int r = 0; r < RMAX; ++r) {
#pragma unroll
            for (int e = 0; e < 8; ++e) sm_acc[warp][r][col0 + e] = acc[r][e];
            if (lane == 0) {
                sm_m[warp][r] = m[r];
                sm_l[warp][r] = l[r];
            }
        }
    }
    __syncthreads();
    if (warp != 0 || grp != 0 || !col_ok) return;
#pragma unroll
    for (int r = 0; r < RMAX; ++r) {
        if (r >= R) break;
        float mn = -ATTN_INF;
#pragma unroll
        for (int w = 0; w < DEC_NW; ++w) mn = fmaxf(mn, sm_m[w][r]);
        const float mu = mn == -ATTN_INF ? 0.f : mn;
        float lt = 0.f, o[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) o[e] = 0.f;
#pragma unroll
        for (int w = 0; w < DEC_NW; ++w) {
            const float a = exp2f(sm_m[w][r] - mu);
            lt += sm_l[w][r] * a;
#pragma unroll
            for (int e = 0; e < 8; ++e) o[e] += sm_acc[w][r][col0 + e] * a;
        }
        const float inv = lt > 0.f ? 1.f / lt : 0.f;
        const float lse = lt > 0.f ? (mn + log2f(lt)) * ATTN_LN2 : -ATTN_INF;
        const int i = r / p.group, h = kvh * p.group + r % p.group;
        if (p.num_splits == 1) {
            elem_t* og = (elem_t*)p.o + (i64)(s.q_start + i) * p.q_stride + (i64)h * d + col0;
#pragma unroll
            for (int e = 0; e < 8; ++e) og[e] = from_f(o[e] * inv);
            if (p.lse && sub == 0) p.lse[lse_index(p, b, s, h, i)] = lse;
        } else {
            const i64 row = ((i64)split * p.total_q + s.q_start + i) * p.hq + h;
            float* op = p.o_part + row * d + col0;
#pragma unroll
            for (int e = 0; e < 8; ++e) op[e] = o[e] * inv;
            if (sub == 0) p.lse_part[row] = lse;
        }
    }
}
