#!/usr/bin/env python3
# Writes kernels/wgmma.cuh: the wgmma wrappers of attn_mma.cu's WG variant (one per accumulator
# width; their operand lists are too long to write by hand).  Usage: python3 scripts/gen-wgmma.py
import os
out = []
out.append("""// Hopper (sm_90a) warpgroup MMA wrappers for attn_mma.cu's WG variant. Written by
// scripts/gen-wgmma.py (edit the script, not this file) from the PTX ISA's wgmma.mma_async
// forms; each wrapper takes its accumulator as an array of N / 2 floats per thread (the layout
// of mma.sync m16n8 accumulators, repeated over n8 blocks).
//
// ss: D (64 x N) += A (64 x 16, shared, K-major) * B (N x 16, shared, K-major)^T: S = Q K^T.
// rs: D (64 x N) += A (64 x 16, registers) * B (16 x N, shared, N-major, transposed): O += P V.
// Shared operands use 128-byte swizzled tiles described by wg_desc().

#if WG
typedef unsigned long long u64;
#if ATTN_DTYPE == 1
#define WG_AB "f16.f16"
#else
#define WG_AB "bf16.bf16"
#endif
__device__ __forceinline__ u64 wg_desc(u32 addr, u32 lbo, u32 sbo) {
    return (u64)((addr & 0x3FFFF) >> 4) | ((u64)((lbo & 0x3FFFF) >> 4) << 16) | ((u64)((sbo & 0x3FFFF) >> 4) << 32) |
           (1ull << 62);
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\\n" ::: "memory"); }
__device__ __forceinline__ void wg_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\\n" ::: "memory"); }
// Keeps the compiler from moving accesses of accumulator registers across the asynchronous MMAs.
template <int N>
__device__ __forceinline__ void wg_fence_regs(float* r) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
""")
def regs(n, start=0):
    return ", ".join(f"%{i}" for i in range(start, start + n))
def outs(n):
    return ", ".join(f'"+f"(d[{i}])' for i in range(n))
for N in (64, 128):
    nr = N // 2
    out.append(f"""__device__ __forceinline__ void wgmma_ss_n{N}(float* d, u64 da, u64 db, int acc) {{
    asm volatile(
        "{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{nr + 2}, 0;\\n"
        "wgmma.mma_async.sync.aligned.m64n{N}k16.f32." WG_AB " "
        "{{{regs(nr)}}}, %{nr}, %{nr + 1}, p, 1, 1, 0, 0;\\n}}\\n"
        : {outs(nr)}
        : "l"(da), "l"(db), "r"(acc));
}}
""")
for N in (64, 128, 192, 256):
    nr = N // 2
    out.append(f"""__device__ __forceinline__ void wgmma_rs_n{N}(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u64 db, int acc) {{
    asm volatile(
        "{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{nr + 5}, 0;\\n"
        "wgmma.mma_async.sync.aligned.m64n{N}k16.f32." WG_AB " "
        "{{{regs(nr)}}}, {{%{nr}, %{nr + 1}, %{nr + 2}, %{nr + 3}}}, %{nr + 4}, p, 1, 1, 1;\\n}}\\n"
        : {outs(nr)}
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(db), "r"(acc));
}}
""")
out.append("""#define WG_CAT2(a, b) a##b
#define WG_CAT(a, b) WG_CAT2(a, b)
#define WGMMA_SS WG_CAT(wgmma_ss_n, BN)
#define WGMMA_RS WG_CAT(wgmma_rs_n, DPAD)
#endif
""")
open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "kernels", "wgmma.cuh"), "w").write("\n".join(out))
