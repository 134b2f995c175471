// FlashAttention-2-style forward on the tensor cores, f16 and bf16 (sm_80 and later).
//
// A CTA owns BM query rows that read one kv head: row r = i * group + hh packs the queries i of
// a sequence with the heads hh of its GQA group, so a K/V tile is loaded once for the group.
// NW warps split the rows (16 * MT each). K and V tiles of BN keys stream through shared memory
// with cp.async, double-buffered; S = Q K^T and O += P V run on mma.sync m16n8k16 with operands
// from ldmatrix; the online softmax stays in registers (P never leaves them); tiles no row can
// see are never loaded. Shared tiles are XOR-swizzled in 16-byte chunks so ldmatrix and the
// async copies are free of bank conflicts. With num_splits > 1 (decode with GQA: a 16-row,
// one-warp tile) each CTA takes a share of the key tiles and writes f32 partials and their lse
// for attn_combine.
//
// Macros: ATTN_DTYPE (1 f16, 2 bf16), DPAD (32, 64, 128, 192 or 256; d <= DPAD, the rest of the
// row is zero-filled), BM, BN, NW (kernel traits chosen on the host, see kernel.rs), POST (1 when
// the call has a softcap or ALiBi slopes: a separate variant, so the common path carries no
// branch or register for them), WG (1: Hopper warpgroup MMAs, sm_90a).
//
// WG variant: each warpgroup (4 warps) owns 64 rows and runs S = Q K^T as wgmma with both
// operands in shared memory and O += P V as wgmma with P in registers (the accumulator layout of
// S is the A-fragment layout, as with mma.sync). Shared tiles then use the 128-byte swizzle
// wgmma reads: [DPAD / 64 column blocks][rows][64 elements], 16-byte chunk c of row r stored at
// chunk c ^ (r & 7), tiles 1024-byte aligned. Everything else (loads, masks, softmax, epilogue)
// is the same code as the mma.sync variant.

#define NT (NW * 32)
#define MT (BM / (16 * NW))
#define NCH (DPAD / 8)
#define NTN (BN / 8)
#define NTD (DPAD / 8)
#define KSTEPS (DPAD / 16)

#ifndef POST
#define POST 0
#endif
#ifndef MINB
#define MINB 1
#endif
#ifndef WG
#define WG 0
#endif
#if WG && (NW % 4 != 0 || BM != 16 * NW || DPAD < 64 || (BN != 64 && BN != 128))
#error "WG tiles: whole warpgroups, 16 rows per warp, DPAD >= 64, BN 64 or 128"
#endif
#ifndef BULK
#define BULK 0
#endif
#if BULK && (WG || BULK < 2 || BULK > 4)
#error "BULK: 2 to 4 stages of bulk copies, mma.sync tiles only"
#endif
#if BULK
// K/V tiles filled by bulk copies (sm_90): one copy per row, so the rows cannot be swizzled;
// they are padded by 16 bytes instead, which keeps ldmatrix free of bank conflicts (8 rows of a
// matrix start 4 banks apart).
#define KSTAGES BULK
#define RSB (DPAD * 2 + 16)
#define KV_ADDR(base, row, c) ((base) + (u32)(row) * RSB + (u32)(c) * 16u)
#else
#define KSTAGES 2
#define KV_ADDR(base, row, c) tile_addr(base, row, c)
#endif

#if ATTN_DTYPE == 1
#define MMA_AB "f16.f16"
#else
#define MMA_AB "bf16.bf16"
#endif

__device__ __forceinline__ int swz(int row, int c) {
#if NCH >= 8
    return c ^ (row & 7);
#else
    return c ^ ((row >> 1) & 3);
#endif
}
__device__ __forceinline__ u32 tile_addr(u32 base, int row, int c) { return base + (u32)(row * NCH + swz(row, c)) * 16u; }
// Address of 16-byte chunk c of row `row` in a tile of `rows` rows.
#if WG
#define TADDR(base, rows, row, c) \
    ((base) + (u32)(((c) >> 3) * (rows) + (row)) * 128u + (u32)((((c) & 7) ^ ((row) & 7)) << 4))
#else
#define TADDR(base, rows, row, c) tile_addr(base, row, c)
#endif

__device__ __forceinline__ void cp_async16(u32 dst, const void* src, bool valid) {
    const int n = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
__device__ __forceinline__ void ldsm_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}
__device__ __forceinline__ void mma16816(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." MMA_AB ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

#if BULK
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
// One arrival that also expects `bytes` more bytes of bulk copies in this phase.
__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    u32 done = 0;
    while (!done)
        asm volatile(
            "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
}
// `bytes` (a multiple of 16) from global memory into this CTA's shared memory, counted on `bar`.
__device__ __forceinline__ void bulk_copy(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}
#endif

// 2^x on the special-function unit (inputs are <= 0 or -inf; flushing denormal results is fine).
__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

extern "C" __global__ void __launch_bounds__(NT, MINB) attn_mma(const AttnParams p) {
    extern __shared__ unsigned char smem_raw[];
    __shared__ int s_lo, s_hi;
#if WG
    // wgmma's swizzle is on absolute address bits: tiles start on 1024-byte boundaries (the
    // host adds 1 KiB of dynamic shared memory for this).
    const u32 sQ = (smem_u32(smem_raw) + 1023u) & ~1023u;
#else
    const u32 sQ = smem_u32(smem_raw);
#endif
#if BULK
    const u32 stage_bytes = BN * RSB;
    __shared__ __align__(8) unsigned long long s_bar[KSTAGES];
    const u32 bar0 = smem_u32(&s_bar[0]);
#else
    const u32 stage_bytes = BN * DPAD * 2;
#endif
    const u32 sK = sQ + BM * DPAD * 2;
    const u32 sV = sK + KSTAGES * stage_bytes;

    const int kvh = blockIdx.y, b = blockIdx.z;
    // blockIdx.x = row block * num_splits + split. Longest (causal) row blocks first: they
    // finish last otherwise.
    const int nsp = p.num_splits;
    const int mblk = gridDim.x / nsp - 1 - blockIdx.x / nsp, split = blockIdx.x % nsp;
    const SeqInfo s = seq_info(p, b);
    const int R = s.q_len * p.group;
    const int m0 = mblk * BM;
    if (m0 >= R) return;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int d = p.d, dch = d >> 3;
    const elem_t* qg = (const elem_t*)p.q;
    const elem_t* kg = (const elem_t*)p.k;
    const elem_t* vg = (const elem_t*)p.v;

    for (int idx = tid; idx < BM * NCH; idx += NT) {
        const int row = idx / NCH, c = idx % NCH;
        const int m = m0 + row;
        const bool ok = m < R && c < dch;
        const elem_t* src = qg;
        if (ok) {
            const int i = m / p.group, h = kvh * p.group + m % p.group;
            src = qg + (i64)(s.q_start + i) * p.q_stride + (i64)h * d + c * 8;
        }
        cp_async16(TADDR(sQ, BM, row, c), src, ok);
    }

#if BULK
    // The bulk copies write d columns of the rows that exist: the padding columns and the rows
    // past the keys must hold zeros (0 * NaN of uninitialised memory would leak into P V), and
    // they keep them, or finite values of earlier tiles, from here on.
    for (u32 i = tid; i < 2u * KSTAGES * stage_bytes / 16u; i += NT)
        asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(sK + i * 16u), "r"(0u) : "memory");
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    if (tid == 0) {
#pragma unroll
        for (int i = 0; i < KSTAGES; ++i) mbar_init(bar0 + 8 * i, 1);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
#endif
    if (tid == 0) {
        s_lo = ATTN_INT_MAX;
        s_hi = 0;
    }
    __syncthreads();
    // Only the two bounds of all this thread's rows stay in registers through the loop; the
    // tiles that cut a row's interval (diagonal, window edges, the end of the keys) recompute the
    // row's interval, since they are few.
    int t_lo_max = 0, t_hi_min = ATTN_INT_MAX;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const int m = m0 + warp * MT * 16 + mt * 16 + hf * 8 + (lane >> 2);
            int lo = 0, hi = 0;
            if (m < R) key_range(p, s, m / p.group, lo, hi);
            t_lo_max = max(t_lo_max, lo);
            t_hi_min = min(t_hi_min, hi);
            if (hi > lo) {
                atomicMin(&s_lo, lo);
                atomicMax(&s_hi, hi);
            }
        }
    }
    __syncthreads();
    const int klo = s_lo, khi = s_hi;
    // Scores stay raw (q.k) in the common path and the scale folds into the exponent's FFMA;
    // with softcap or ALiBi they are transformed first, in log2 units.
    const float sl = POST ? 1.f : p.scale_log2;

    float O[MT][NTD][4];
    float rm[MT][2], rl[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int nt = 0; nt < NTD; ++nt) O[mt][nt][0] = O[mt][nt][1] = O[mt][nt][2] = O[mt][nt][3] = 0.f;
        rm[mt][0] = rm[mt][1] = -ATTN_INF;
        rl[mt][0] = rl[mt][1] = 0.f;
    }

    // With split-KV (decode with GQA, long keys) this CTA takes one share of the key tiles and
    // writes a partial result and its lse; attn_combine merges the shares.
    int nb0 = 0, nb1 = 0;
    if (klo < khi) {
        nb0 = klo / BN;
        nb1 = (khi + BN - 1) / BN;
        if (nsp > 1) {
            const int per = (nb1 - nb0 + nsp - 1) / nsp;
            nb0 += split * per;
            nb1 = min(nb1, nb0 + per);
        }
    }
    if (nb0 < nb1) {
#if BULK
        // One bulk copy per K row and per V row that exists (d * 2 bytes each), all counted on
        // the stage's barrier; one thread arms it with the tile's byte count first.
        auto load_kv = [&](int nb, int st) {
            const int n0 = nb * BN;
            const u32 dk = sK + st * stage_bytes, dv = sV + st * stage_bytes, bar = bar0 + 8 * st;
            const int nrows = min(BN, s.k_len - n0);
            if (tid == 0) mbar_expect_tx(bar, (u32)(nrows * d * 4));
            if (NW == 1)
                __syncwarp();
            else
                __syncthreads();
            for (int row = tid; row < nrows; row += NT) {
                const i64 off = kv_row(p, b, s, n0 + row) * p.kv_stride + (i64)kvh * d;
                bulk_copy(KV_ADDR(dk, row, 0), kg + off, (u32)(d * 2), bar);
                bulk_copy(KV_ADDR(dv, row, 0), vg + off, (u32)(d * 2), bar);
            }
        };
#else
        // Each thread copies fixed 16-byte columns of the K and V rows it owns, so the per-tile
        // work is one row index and one (dense) multiply; paged rows look up their block.
#if (NT % NCH) == 0
        constexpr int RS = NT / NCH;
        constexpr int ITERS = (BN + RS - 1) / RS;
        const int lc = tid % NCH, lr0 = tid / NCH;
        const bool lc_ok = lc < dch;
        const i64 col_off = (i64)kvh * d + lc * 8;
#if !WG && NW > 1
        // The mma.sync prefill tiles keep the row-by-row loader: on an H200 the two-phase one
        // below cost them registers (44 bytes of spills at d 128) and 9% (280 against 307
        // TFLOP/s at d 128, 8k, with `ATTNKIT_CUDA_WGMMA=off`).
        auto load_kv = [&](int nb, int st) {
            const int n0 = nb * BN;
            const u32 dk = sK + st * stage_bytes, dv = sV + st * stage_bytes;
#pragma unroll
            for (int it = 0; it < ITERS; ++it) {
                const int row = lr0 + it * RS;
                if (ITERS * RS > BN && row >= BN) break;
                const int t = n0 + row;
                const bool ok = lc_ok && t < s.k_len;
                i64 off = 0;
                if (ok) off = kv_row(p, b, s, t) * p.kv_stride + col_off;
                cp_async16(TADDR(dk, BN, row, lc), kg + off, ok);
                cp_async16(TADDR(dv, BN, row, lc), vg + off, ok);
            }
        };
#else
        auto load_kv = [&](int nb, int st) {
            const int n0 = nb * BN;
            const u32 dk = sK + st * stage_bytes, dv = sV + st * stage_bytes;
            // Every row's address first, then every copy: a paged row's address is a load from
            // the block table, and issuing them all before the first copy overlaps their
            // latencies (row by row, each copy waited for its own lookup). The layout test is
            // uniform, so it stays outside the rows. Row indices fit in 31 bits (the host
            // refuses larger k/v); -1 marks a row past the keys (zero-filled).
            int rows[ITERS];
            if (p.layout == 2 && p.bs_shift >= 0) {
                const int* bt = p.block_table + (i64)b * p.max_blocks;
                const int sh = p.bs_shift, msk = p.block_size - 1;
#pragma unroll
                for (int it = 0; it < ITERS; ++it) {
                    const int t = n0 + lr0 + it * RS;
                    rows[it] = lc_ok && t < s.k_len && lr0 + it * RS < BN ? (bt[t >> sh] << sh) | (t & msk) : -1;
                }
            } else if (p.layout == 2) {
#pragma unroll
                for (int it = 0; it < ITERS; ++it) {
                    const int t = n0 + lr0 + it * RS;
                    rows[it] = lc_ok && t < s.k_len && lr0 + it * RS < BN ? (int)kv_row(p, b, s, t) : -1;
                }
            } else {
#pragma unroll
                for (int it = 0; it < ITERS; ++it) {
                    const int t = n0 + lr0 + it * RS;
                    rows[it] = lc_ok && t < s.k_len && lr0 + it * RS < BN ? s.k_start + t : -1;
                }
            }
#pragma unroll
            for (int it = 0; it < ITERS; ++it) {
                const int row = lr0 + it * RS;
                if (ITERS * RS > BN && row >= BN) break;
                const bool ok = rows[it] >= 0;
                const i64 off = ok ? (i64)rows[it] * p.kv_stride + col_off : 0;
                cp_async16(TADDR(dk, BN, row, lc), kg + off, ok);
                cp_async16(TADDR(dv, BN, row, lc), vg + off, ok);
            }
        };
#endif
#else
        // As above (row addresses first, then the copies), with a row and column per copy, in
        // groups of 8 copies so that the addresses held stay few.
        constexpr int GITERS = (BN * NCH + NT - 1) / NT;
        auto load_kv = [&](int nb, int st) {
            const int n0 = nb * BN;
#pragma unroll
            for (int g0 = 0; g0 < GITERS; g0 += 8) {
                int rows[8];
#pragma unroll
                for (int it = 0; it < 8; ++it) {
                    const int idx = tid + (g0 + it) * NT, row = idx / NCH, c = idx % NCH;
                    const int t = n0 + row;
                    const bool in = g0 + it < GITERS && idx < BN * NCH;
                    rows[it] = in && t < s.k_len && c < dch ? (int)kv_row(p, b, s, t) : -1;
                }
#pragma unroll
                for (int it = 0; it < 8; ++it) {
                    const int idx = tid + (g0 + it) * NT, row = idx / NCH, c = idx % NCH;
                    if (g0 + it >= GITERS || idx >= BN * NCH) break;
                    const bool ok = rows[it] >= 0;
                    const i64 off = ok ? (i64)rows[it] * p.kv_stride + (i64)kvh * d + c * 8 : 0;
                    cp_async16(TADDR(sK + st * stage_bytes, BN, row, c), kg + off, ok);
                    cp_async16(TADDR(sV + st * stage_bytes, BN, row, c), vg + off, ok);
                }
            }
        };
#endif
#endif  // BULK
#if BULK
        // KSTAGES - 1 tiles ahead; the stage a tile goes into was last read before the closing
        // barrier of the previous iteration.
        cp_async_commit();
#pragma unroll
        for (int i = 0; i < KSTAGES - 1; ++i)
            if (nb0 + i < nb1) load_kv(nb0 + i, i);
        cp_async_wait<0>();
        __syncthreads();
        for (int nb = nb0; nb < nb1; ++nb) {
            const int it = nb - nb0, st = it % KSTAGES;
            if (nb + KSTAGES - 1 < nb1) load_kv(nb + KSTAGES - 1, (it + KSTAGES - 1) % KSTAGES);
            mbar_wait(bar0 + 8 * st, (u32)(it / KSTAGES) & 1u);
#else
        load_kv(nb0, 0);
        cp_async_commit();
        for (int nb = nb0; nb < nb1; ++nb) {
            const int st = (nb - nb0) & 1;
            if (nb + 1 < nb1) {
                load_kv(nb + 1, st ^ 1);
                cp_async_commit();
                cp_async_wait<1>();
            } else {
                cp_async_wait<0>();
            }
#if WG
            // The tiles were written through the generic proxy; wgmma reads them through the
            // async proxy.
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
            __syncthreads();
#endif
            const u32 kbase = sK + st * stage_bytes, vbase = sV + st * stage_bytes;

            float S[MT][NTN][4];
#if WG
            {
                // This warpgroup's 64 rows of Q; K-major operands step 32 bytes (16 elements)
                // inside a swizzled 128-byte row, then to the next 64-column block.
                const u32 qbase = sQ + (u32)(warp >> 2) * 64u * 128u;
                wg_fence();
#pragma unroll
                for (int ks = 0; ks < KSTEPS; ++ks) {
                    const u32 qo = (u32)(ks >> 2) * BM * 128u + (u32)(ks & 3) * 32u;
                    const u32 ko = (u32)(ks >> 2) * BN * 128u + (u32)(ks & 3) * 32u;
                    WGMMA_SS(&S[0][0][0], wg_desc(qbase + qo, 16, 1024), wg_desc(kbase + ko, 16, 1024), ks > 0);
                }
                wg_commit();
                wg_wait0();
                wg_fence_regs<NTN * 4>(&S[0][0][0]);
            }
#else
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < NTN; ++nt) S[mt][nt][0] = S[mt][nt][1] = S[mt][nt][2] = S[mt][nt][3] = 0.f;
#pragma unroll
            for (int ks = 0; ks < KSTEPS; ++ks) {
                u32 a[MT][4];
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
                    ldsm_x4(tile_addr(sQ, warp * MT * 16 + mt * 16 + (lane & 15), ks * 2 + (lane >> 4)), a[mt][0], a[mt][1],
                            a[mt][2], a[mt][3]);
#pragma unroll
                for (int np = 0; np < BN / 16; ++np) {
                    u32 b0, b1, b2, b3;
                    ldsm_x4(KV_ADDR(kbase, np * 16 + (lane & 7) + ((lane >> 4) << 3), ks * 2 + ((lane >> 3) & 1)), b0, b1, b2,
                            b3);
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        mma16816(S[mt][2 * np], a[mt], b0, b1);
                        mma16816(S[mt][2 * np + 1], a[mt], b2, b3);
                    }
                }
            }
#endif

            const int n0 = nb * BN;
            const bool need = n0 < t_lo_max || n0 + BN > t_hi_min;
            float alpha[MT][2];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
                for (int hf = 0; hf < 2; ++hf) {
                    const int m = m0 + warp * MT * 16 + mt * 16 + hf * 8 + (lane >> 2);
#if POST
                    {
                        const int ia = m / p.group + s.k_len - s.q_len;
                        const float slope = p.alibi && m < R ? p.alibi[kvh * p.group + m % p.group] : 0.f;
#pragma unroll
                        for (int nt = 0; nt < NTN; ++nt)
#pragma unroll
                            for (int e = 0; e < 2; ++e) {
                                const int j = n0 + nt * 8 + 2 * (lane & 3) + e;
                                float& x = S[mt][nt][hf * 2 + e];
                                x = score_post(p, x * p.scale, slope, ia, j) * ATTN_LOG2E;
                            }
                    }
#endif
                    if (need) {
                        int lo = 0, hi = 0;
                        if (m < R) key_range(p, s, m / p.group, lo, hi);
#pragma unroll
                        for (int nt = 0; nt < NTN; ++nt)
#pragma unroll
                            for (int e = 0; e < 2; ++e) {
                                const int j = n0 + nt * 8 + 2 * (lane & 3) + e;
                                if (j < lo || j >= hi) S[mt][nt][hf * 2 + e] = -ATTN_INF;
                            }
                    }
                    float mx = -ATTN_INF;
#pragma unroll
                    for (int nt = 0; nt < NTN; ++nt) mx = fmaxf(mx, fmaxf(S[mt][nt][hf * 2], S[mt][nt][hf * 2 + 1]));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                    const float m_new = fmaxf(rm[mt][hf], mx);
                    // A row with nothing visible yet keeps max -inf; its p and alpha must be 0
                    // and 1 without forming inf - inf.
                    const float m_sc = m_new == -ATTN_INF ? 0.f : m_new * sl;
                    alpha[mt][hf] = ex2(rm[mt][hf] * sl - m_sc);
                    rm[mt][hf] = m_new;
                    float ls = 0.f;
#pragma unroll
                    for (int nt = 0; nt < NTN; ++nt) {
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            const float pv = ex2(fmaf(S[mt][nt][hf * 2 + e], sl, -m_sc));
                            S[mt][nt][hf * 2 + e] = pv;
                            ls += pv;
                        }
                    }
                    rl[mt][hf] = rl[mt][hf] * alpha[mt][hf] + ls;
                }
            }
            // Once the running maxima settle, most tiles leave every row's max unchanged:
            // the warp then skips rescaling O (alpha is exactly 1 for all its rows).
            bool rescale = false;
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) rescale |= alpha[mt][0] != 1.f || alpha[mt][1] != 1.f;
            if (__any_sync(0xffffffffu, rescale)) {
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int nt = 0; nt < NTD; ++nt) {
                        O[mt][nt][0] *= alpha[mt][0];
                        O[mt][nt][1] *= alpha[mt][0];
                        O[mt][nt][2] *= alpha[mt][1];
                        O[mt][nt][3] *= alpha[mt][1];
                    }
            }

#if WG
            // V is the N-major B operand: 16 keys (two 8-row groups, 1024 bytes apart) per step,
            // 64-column blocks BN * 128 bytes apart.
            // P is packed whole before the first MMA: registers written between asynchronous
            // MMAs would make the compiler wait for the ones in flight.
            u32 P[BN / 16][4];
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk) {
                P[kk][0] = pack2(S[0][2 * kk][0], S[0][2 * kk][1]);
                P[kk][1] = pack2(S[0][2 * kk][2], S[0][2 * kk][3]);
                P[kk][2] = pack2(S[0][2 * kk + 1][0], S[0][2 * kk + 1][1]);
                P[kk][3] = pack2(S[0][2 * kk + 1][2], S[0][2 * kk + 1][3]);
            }
            wg_fence_regs<NTD * 4>(&O[0][0][0]);
            wg_fence();
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk)
                WGMMA_RS(&O[0][0][0], P[kk][0], P[kk][1], P[kk][2], P[kk][3], wg_desc(vbase + (u32)kk * 2048u, BN * 128u, 1024), 1);
            wg_commit();
            wg_wait0();
            wg_fence_regs<NTD * 4>(&O[0][0][0]);
#else
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk) {
                u32 a[MT][4];
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    a[mt][0] = pack2(S[mt][2 * kk][0], S[mt][2 * kk][1]);
                    a[mt][1] = pack2(S[mt][2 * kk][2], S[mt][2 * kk][3]);
                    a[mt][2] = pack2(S[mt][2 * kk + 1][0], S[mt][2 * kk + 1][1]);
                    a[mt][3] = pack2(S[mt][2 * kk + 1][2], S[mt][2 * kk + 1][3]);
                }
#pragma unroll
                for (int dp = 0; dp < DPAD / 16; ++dp) {
                    u32 b0, b1, b2, b3;
                    ldsm_x4_t(KV_ADDR(vbase, kk * 16 + (lane & 7) + (((lane >> 3) & 1) << 3), dp * 2 + (lane >> 4)), b0, b1,
                              b2, b3);
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        mma16816(O[mt][2 * dp], a[mt], b0, b1);
                        mma16816(O[mt][2 * dp + 1], a[mt], b2, b3);
                    }
                }
            }
#endif
            __syncthreads();
        }
    } else {
        cp_async_commit();
        cp_async_wait<0>();
    }

#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            float l = rl[mt][hf];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            const int m = m0 + warp * MT * 16 + mt * 16 + hf * 8 + (lane >> 2);
            if (m < R) {
                const int i = m / p.group, h = kvh * p.group + m % p.group;
                const float inv = l > 0.f ? 1.f / l : 0.f;
                const float lse2 = l > 0.f ? rm[mt][hf] * sl + log2f(l) : -ATTN_INF;
                if (nsp == 1) {
                    elem_t* og = (elem_t*)p.o + (i64)(s.q_start + i) * p.q_stride + (i64)h * d;
#pragma unroll
                    for (int nt = 0; nt < NTD; ++nt) {
                        const int col = nt * 8 + 2 * (lane & 3);
                        if (col < d) *(u32*)(og + col) = pack2(O[mt][nt][hf * 2] * inv, O[mt][nt][hf * 2 + 1] * inv);
                    }
                    if (p.lse && (lane & 3) == 0) p.lse[lse_index(p, b, s, h, i)] = lse2 * ATTN_LN2;
                } else {
                    // Partials in f32, [split][total_q][hq][d], lse in natural units; an empty
                    // share writes zeros and -inf (the workspace is never cleared).
                    const i64 row = ((i64)split * p.total_q + s.q_start + i) * p.hq + h;
                    float* op = p.o_part + row * d;
#pragma unroll
                    for (int nt = 0; nt < NTD; ++nt) {
                        const int col = nt * 8 + 2 * (lane & 3);
                        if (col < d) *(float2*)(op + col) = make_float2(O[mt][nt][hf * 2] * inv, O[mt][nt][hf * 2 + 1] * inv);
                    }
                    if ((lane & 3) == 0) p.lse_part[row] = lse2 * ATTN_LN2;
                }
            }
        }
    }
}
