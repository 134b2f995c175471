// Shared by every attnkit CUDA kernel. Compiled by NVRTC at run time, prepended to each kernel
// source; it needs no CUDA toolkit header (half and bfloat16 are handled as raw 16-bit words
// through PTX conversions).
//
// Macros set by the host: ATTN_DTYPE (0 = f32, 1 = f16, 2 = bf16) and per-kernel tile sizes.

typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

#define ATTN_INF __int_as_float(0x7f800000)
#define ATTN_LOG2E 1.4426950408889634f
#define ATTN_LN2 0.6931471805599453f
#define ATTN_INT_MAX 0x7fffffff

// Must match `KernelParams` in backends/cuda/kernel.rs field for field.
struct AttnParams {
    const void* q;
    const void* k;
    const void* v;
    void* o;
    float* lse;          // null: lse not wanted
    float* o_part;       // split-KV partial outputs [splits][total_q][hq][d] (f32)
    float* lse_part;     // split-KV partial lse [splits][total_q][hq] (natural log)
    const int* cu_q;     // varlen/paged
    const int* cu_k;     // varlen
    const int* block_table;
    const int* seq_lens;
    const float* alibi;  // null: no ALiBi
    i64 q_stride;        // elements between tokens of q and o (hq * d)
    i64 kv_stride;       // elements between rows of k and v (hkv * d)
    int batch, hq, hkv, d;
    int group, layout, dense_sq, dense_sk;
    int block_size, max_blocks, total_q, causal;
    int window_left, window_right, num_splits, bs_shift;  // bs_shift: log2(block_size), or -1
    float scale, softcap, scale_log2, pad1;
};

__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ float bf16_to_f32(u16 h) { return __uint_as_float(((u32)h) << 16); }
__device__ __forceinline__ u16 f32_to_f16(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
__device__ __forceinline__ u16 f32_to_bf16(float f) {
    u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
// Two floats to a packed pair, `lo` in the low half (the element with the smaller index).
__device__ __forceinline__ u32 pack_f16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

#if ATTN_DTYPE == 0
typedef float elem_t;
__device__ __forceinline__ float to_f(elem_t x) { return x; }
__device__ __forceinline__ elem_t from_f(float x) { return x; }
#elif ATTN_DTYPE == 1
typedef u16 elem_t;
__device__ __forceinline__ float to_f(elem_t x) { return f16_to_f32(x); }
__device__ __forceinline__ elem_t from_f(float x) { return f32_to_f16(x); }
__device__ __forceinline__ u32 pack2(float lo, float hi) { return pack_f16x2(lo, hi); }
#else
typedef u16 elem_t;
__device__ __forceinline__ float to_f(elem_t x) { return bf16_to_f32(x); }
__device__ __forceinline__ elem_t from_f(float x) { return f32_to_bf16(x); }
__device__ __forceinline__ u32 pack2(float lo, float hi) { return pack_bf16x2(lo, hi); }
#endif

struct SeqInfo {
    int q_start, q_len, k_start, k_len;
};

// Layouts: 0 dense, 1 varlen, 2 paged (the SPEC's three).
__device__ __forceinline__ SeqInfo seq_info(const AttnParams& p, int b) {
    SeqInfo s;
    if (p.layout == 0) {
        s.q_start = b * p.dense_sq;
        s.q_len = p.dense_sq;
        s.k_start = b * p.dense_sk;
        s.k_len = p.dense_sk;
    } else if (p.layout == 1) {
        s.q_start = p.cu_q[b];
        s.q_len = p.cu_q[b + 1] - s.q_start;
        s.k_start = p.cu_k[b];
        s.k_len = p.cu_k[b + 1] - s.k_start;
    } else {
        s.q_start = p.cu_q[b];
        s.q_len = p.cu_q[b + 1] - s.q_start;
        s.k_start = 0;
        s.k_len = p.seq_lens[b];
    }
    return s;
}

// Row of key token `t` (< k_len) of sequence `b` in k/v seen as [rows, hkv, d].
__device__ __forceinline__ i64 kv_row(const AttnParams& p, int b, const SeqInfo& s, int t) {
    if (p.layout == 2) {
        if (p.bs_shift >= 0) {
            const int blk = p.block_table[(i64)b * p.max_blocks + (t >> p.bs_shift)];
            return ((i64)blk << p.bs_shift) + (t & (p.block_size - 1));
        }
        const int blk = p.block_table[(i64)b * p.max_blocks + t / p.block_size];
        return (i64)blk * p.block_size + t % p.block_size;
    }
    return (i64)s.k_start + t;
}

// Keys [lo, hi) visible to query i (bottom-right aligned); every mask of the contract is an
// interval. The host clamps the windows to 1 << 30, so nothing here overflows.
__device__ __forceinline__ void key_range(const AttnParams& p, const SeqInfo& s, int i, int& lo, int& hi) {
    int ia = i + s.k_len - s.q_len;
    lo = 0;
    hi = s.k_len;
    if (p.causal) hi = min(hi, ia + 1);
    if (p.window_left >= 0) lo = max(lo, ia - p.window_left);
    if (p.window_right >= 0) hi = min(hi, ia + p.window_right + 1);
    if (hi <= lo) {
        lo = 0;
        hi = 0;
    }
}

__device__ __forceinline__ i64 lse_index(const AttnParams& p, int b, const SeqInfo& s, int h, int i) {
    return p.layout == 0 ? ((i64)b * p.hq + h) * p.dense_sq + i : (i64)h * p.total_q + s.q_start + i;
}

// Softcap then ALiBi on a scaled score, in natural units.
__device__ __forceinline__ float score_post(const AttnParams& p, float s, float slope, int ia, int j) {
    if (p.softcap > 0.f) s = p.softcap * tanhf(s / p.softcap);
    if (slope != 0.f) s -= slope * fabsf((float)(ia - j));
    return s;
}

__device__ __forceinline__ u32 smem_u32(const void* ptr) {
    u32 r;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(ptr));
    return r;
}
