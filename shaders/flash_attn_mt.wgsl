// Tiled flash attention with register micro-tiles (portable path: f32 arithmetic, no subgroups).
//
// The same contract, bindings and metadata as flash_attn.wgsl (read that first); the difference
// is the inner work. This file keeps its own copy of that shared text rather than including
// shaders/include/: with the includes in its place (the same functions, the tile loads and the
// lse rows otherwise unchanged) an H100 (Vulkan, driver 580) ran it 22-27% slower at f16, bf16
// and f32, B4 H16 S4096 D128 (86.6-87.1 ms against 68.6-71.2 ms in the same call).
// Each of the (BQ/4)*(BK/4) threads owns a 4x4 block of the score tile and a 4-row block of the
// output, so every workgroup-memory load feeds 4 (scores) or 4*NV (output) FMAs instead of one:
//   S = Q K^T:  Q and K tiles are stored transposed ([d][4 rows] vec4), outer products over d;
//   softmax:    each thread on its own 4x4 scores: the block maxima meet in workgroup memory,
//               every thread of a row group then derives the same new maxima and factors, and
//               writes its P block (transposed); the row sums are added up once at the end;
//   O += P V:   P read as [key][4 rows] vec4, V as [key][d] vec4.
// K and V share one workgroup buffer (K is consumed before V is stored), which is what makes
// 32x32 tiles of head dim 128 fit 48 KiB.
//
// Global loads run one phase ahead: a tile's V is loaded into registers (raw words) before its
// q.k and stored to workgroup memory after it; the next tile's K is loaded before this tile's p.v.
// So the loads of a workgroup overlap its own arithmetic (on an H200 the loads, issued and waited
// for in place, took half the kernel's time).
//
// Non-finite V elements are zeroed as they are stored: the contract lets a non-finite visible
// value spoil its row, but a row that cannot see it would otherwise get 0 * NaN.

const D: u32 = 128u; // @spec head dim, a multiple of 4
const DT: u32 = 0u; // @spec storage dtype: 0 f32, 1 f16 (two per u32), 2 bf16 (two per u32)
const BQ: u32 = 32u; // @spec rows per workgroup, a multiple of 4
const BK: u32 = 32u; // @spec keys per tile, a multiple of 4

const QG: u32 = BQ / 4u; // row groups
const KG: u32 = BK / 4u; // key groups
const WG: u32 = QG * KG;
const D4: u32 = D / 4u;
const NV: u32 = (D4 + KG - 1u) / KG; // output vec4 columns per thread
const KI: u32 = (KG * D4 + WG - 1u) / WG; // (key group, column) items of the K tile per thread
const VI: u32 = (BK * D4 + WG - 1u) / WG; // (key, column) items of the V tile per thread
const NEG: f32 = -3.0e38;
const MASKED: f32 = -3.3e38; // below NEG: a score no row may use

const M_HQ: u32 = 1u;
const M_HKV: u32 = 2u;
const M_KIND: u32 = 3u;
const M_SQ: u32 = 4u;
const M_SK: u32 = 5u;
const M_TQ: u32 = 6u;
const M_BS: u32 = 7u;
const M_MAXB: u32 = 8u;
const M_CAUSAL: u32 = 9u;
const M_WL: u32 = 10u;
const M_WR: u32 = 11u;
const M_CAP: u32 = 12u;
const M_SCALE: u32 = 13u;
const M_ALIBI: u32 = 14u;
const M_LSE: u32 = 15u;
const M_SPLITS: u32 = 16u;
const M_OFF_CUQ: u32 = 17u;
const M_OFF_CUK: u32 = 18u;
const M_OFF_BT: u32 = 19u;
const M_OFF_ALIBI: u32 = 20u;

// Tensors as 8-byte words: one word is 4 elements of f16/bf16, or 2 of f32. D is a multiple of 4,
// so every vec4 of a row starts on a word.
@group(0) @binding(0) var<storage, read> qb: array<vec2<u32>>;
@group(0) @binding(1) var<storage, read> kb: array<vec2<u32>>;
@group(0) @binding(2) var<storage, read> vb: array<vec2<u32>>;
@group(0) @binding(3) var<storage, read_write> ob: array<vec2<u32>>;
@group(0) @binding(4) var<storage, read_write> lseb: array<f32>;
@group(0) @binding(5) var<storage, read> md: array<u32>;
@group(0) @binding(6) var<storage, read_write> part_o: array<vec4<f32>>;
@group(0) @binding(7) var<storage, read_write> part_lse: array<f32>;

var<workgroup> qt: array<vec4<f32>, D * QG>; // [d][row group]
var<workgroup> kv: array<vec4<f32>, D * KG>; // K as [d][key group], then V as [key][d/4]
var<workgroup> pt: array<vec4<f32>, BK * QG>; // P as [key][row group]
// Per (key group, row group): the 4 rows' maxima over the block's 4 keys; at the end, the rows'
// partial sums.
var<workgroup> red: array<vec4<f32>, KG * QG>;

fn bf16x2(w: u32) -> vec2<f32> {
    return vec2<f32>(bitcast<f32>(w << 16u), bitcast<f32>(w & 0xffff0000u));
}

fn to_bf16(x: f32) -> u32 {
    let b = bitcast<u32>(x);
    if ((b & 0x7fffffffu) > 0x7f800000u) {
        return (b >> 16u) | 0x40u;
    }
    return (b + 0x7fffu + ((b >> 16u) & 1u)) >> 16u;
}

fn unpack4(w0: u32, w1: u32, w2: u32, w3: u32) -> vec4<f32> {
    return vec4<f32>(bitcast<f32>(w0), bitcast<f32>(w1), bitcast<f32>(w2), bitcast<f32>(w3));
}
fn half4(w0: u32, w1: u32) -> vec4<f32> {
    if (DT == 1u) {
        return vec4<f32>(unpack2x16float(w0), unpack2x16float(w1));
    }
    return vec4<f32>(bf16x2(w0), bf16x2(w1));
}
fn load_q(e: u32) -> vec4<f32> {
    if (DT == 0u) {
        let a = qb[e / 2u];
        let b = qb[e / 2u + 1u];
        return unpack4(a.x, a.y, b.x, b.y);
    }
    let w = qb[e / 4u];
    return half4(w.x, w.y);
}
// Integer test, so that no finite-math assumption of a compiler can remove it.
fn finite4(x: vec4<f32>) -> vec4<f32> {
    let bad = (bitcast<vec4<u32>>(x) & vec4<u32>(0x7f800000u)) == vec4<u32>(0x7f800000u);
    return select(x, vec4<f32>(0.0), bad);
}
// Raw words of the vec4 at element `e`: 4 for f32, 2 for f16/bf16 (z and w unused). The tile
// loads keep these in registers across the previous phase's arithmetic and widen them on the
// store to workgroup memory.
fn raw_k(e: u32) -> vec4<u32> {
    if (DT == 0u) {
        return vec4<u32>(kb[e / 2u], kb[e / 2u + 1u]);
    }
    return vec4<u32>(kb[e / 4u], 0u, 0u);
}
fn raw_v(e: u32) -> vec4<u32> {
    if (DT == 0u) {
        return vec4<u32>(vb[e / 2u], vb[e / 2u + 1u]);
    }
    return vec4<u32>(vb[e / 4u], 0u, 0u);
}
fn widen(w: vec4<u32>) -> vec4<f32> {
    if (DT == 0u) {
        return bitcast<vec4<f32>>(w);
    }
    return half4(w.x, w.y);
}
fn store_o(e: u32, x: vec4<f32>) {
    if (DT == 0u) {
        ob[e / 2u] = bitcast<vec2<u32>>(x.xy);
        ob[e / 2u + 1u] = bitcast<vec2<u32>>(x.zw);
    } else if (DT == 1u) {
        ob[e / 4u] = vec2<u32>(pack2x16float(x.xy), pack2x16float(x.zw));
    } else {
        ob[e / 4u] = vec2<u32>(to_bf16(x.x) | (to_bf16(x.y) << 16u), to_bf16(x.z) | (to_bf16(x.w) << 16u));
    }
}

struct Seq {
    q0: u32,
    ql: u32,
    k0: u32,
    kl: u32,
}

fn seq_of(b: u32) -> Seq {
    let kind = md[M_KIND];
    if (kind == 0u) {
        let sq = md[M_SQ];
        let sk = md[M_SK];
        return Seq(b * sq, sq, b * sk, sk);
    }
    let cq = md[M_OFF_CUQ];
    let ck = md[M_OFF_CUK];
    let q0 = md[cq + b];
    let ql = md[cq + b + 1u] - q0;
    if (kind == 1u) {
        let k0 = md[ck + b];
        return Seq(q0, ql, k0, md[ck + b + 1u] - k0);
    }
    return Seq(q0, ql, 0u, md[ck + b]);
}

// Where the kv tokens of one sequence are, read from the metadata once per workgroup.
struct Kv {
    paged: bool,
    bs: u32,
    bt: u32, // first block-table entry of the sequence in md
    k0: u32,
}

fn kv_of(b: u32, s: Seq) -> Kv {
    return Kv(md[M_KIND] == 2u, max(md[M_BS], 1u), md[M_OFF_BT] + b * md[M_MAXB], s.k0);
}

// Row of kv token `t` in k/v seen as [rows, Hkv, D].
fn k_row(kvl: Kv, t: u32) -> u32 {
    if (kvl.paged) {
        return md[kvl.bt + t / kvl.bs] * kvl.bs + t % kvl.bs;
    }
    return kvl.k0 + t;
}

fn key_range(i: u32, s: Seq) -> vec2<i32> {
    let ia = i32(i) + i32(s.kl) - i32(s.ql);
    var lo = 0;
    var hi = i32(s.kl);
    if (md[M_CAUSAL] != 0u) {
        hi = min(hi, ia + 1);
    }
    let wl = bitcast<i32>(md[M_WL]);
    if (wl >= 0) {
        lo = max(lo, ia - wl);
    }
    let wr = bitcast<i32>(md[M_WR]);
    if (wr >= 0) {
        hi = min(hi, ia + wr + 1);
    }
    if (hi <= lo) {
        return vec2<i32>(0, 0);
    }
    return vec2<i32>(lo, hi);
}

// One row's visible key interval within [start, end), its query position (for ALiBi) and slope.
struct RowInfo {
    lo: i32,
    hi: i32,
    ia: i32,
    sl: f32,
}

fn row_info(p: u32, nrows: u32, g: u32, s: Seq, kh: u32, start: i32, end: i32) -> RowInfo {
    var kr = vec2<i32>(0, 0);
    var slope = 0.0;
    if (p < nrows) {
        kr = key_range(p / g, s);
        if (md[M_ALIBI] != 0u) {
            slope = bitcast<f32>(md[md[M_OFF_ALIBI] + kh * g + p % g]);
        }
    }
    return RowInfo(max(kr.x, start), min(kr.y, end), i32(p / g) + i32(s.kl) - i32(s.ql), slope);
}

// Vec4 `c` of row `p` of the Q tile (0 past the last row).
fn q_vec(p: u32, nrows: u32, g: u32, s: Seq, kh: u32, c: u32) -> vec4<f32> {
    if (p >= nrows) {
        return vec4<f32>(0.0);
    }
    let hq = md[M_HQ];
    return load_q(((s.q0 + p / g) * hq + kh * g + p % g) * D + c * 4u);
}

// One row's 4 scores (keys jv): scale, softcap, ALiBi, and MASKED outside the row's interval.
// A select, not arithmetic: a NaN score of a masked key is dropped here.
fn score4(a: vec4<f32>, jv: vec4<i32>, r: RowInfo, scale: f32, cap: f32) -> vec4<f32> {
    var x = scale * a;
    if (cap > 0.0) {
        let y = x / cap;
        let z = exp(-2.0 * abs(y));
        x = cap * sign(y) * (1.0 - z) / (1.0 + z);
    }
    x -= r.sl * vec4<f32>(abs(vec4<i32>(r.ia) - jv));
    return select(vec4<f32>(MASKED), x, (jv >= vec4<i32>(r.lo)) & (jv < vec4<i32>(r.hi)));
}

fn max4(x: vec4<f32>) -> f32 {
    return max(max(x.x, x.y), max(x.z, x.w));
}

// Where row `p`'s output starts: an element index of `ob` (one split), else a vec4 index of
// `part_o`.
fn out_base(p: u32, g: u32, s: Seq, kh: u32, split: u32, splits: u32) -> u32 {
    let hq = md[M_HQ];
    let row = s.q0 + p / g;
    let h = kh * g + p % g;
    if (splits == 1u) {
        return (row * hq + h) * D;
    }
    return ((split * md[M_TQ] + row) * hq + h) * D4;
}

fn emit(ok: bool, base: u32, c: u32, x: vec4<f32>, splits: u32) {
    if (ok) {
        if (splits == 1u) {
            store_o(base + c * 4u, x);
        } else {
            part_o[base + c] = x;
        }
    }
}

fn emit_lse(ok: bool, p: u32, lr: f32, mr: f32, b: u32, g: u32, s: Seq, kh: u32, split: u32, splits: u32) {
    if (!ok) {
        return;
    }
    let hq = md[M_HQ];
    let i = p / g;
    let h = kh * g + p % g;
    let row = s.q0 + i;
    if (splits == 1u) {
        if (md[M_LSE] != 0u) {
            var lv = bitcast<f32>(0xff800000u); // -inf
            if (lr > 0.0) {
                lv = mr + log(lr);
            }
            var li = h * md[M_TQ] + row;
            if (md[M_KIND] == 0u) {
                li = (b * hq + h) * md[M_SQ] + i;
            }
            lseb[li] = lv;
        }
    } else {
        var lv = NEG;
        if (lr > 0.0) {
            lv = mr + log(lr);
        }
        part_lse[(split * md[M_TQ] + row) * hq + h] = lv;
    }
}

// The P tile is stored [key][row group] with the row group XOR-swizzled by the key's group, so
// that the 8 threads of a row group that store one key each write 8 different bank groups.
fn pt_at(key: u32, rg: u32) -> u32 {
    return key * QG + (rg ^ ((key / 4u) & (QG - 1u)));
}

// The K tile is stored [d][key group] with the key group XOR-swizzled by the column (d / 4), so
// that the 8 threads of a store phase, which hold 8 consecutive columns of one key group, write 8
// different bank groups.
fn kt_at(d: u32, kg: u32) -> u32 {
    return d * KG + (kg ^ ((d / 4u) & (KG - 1u)));
}

// Per-thread state lives in named vectors, and per-thread arrays (the output rows, the K/V words
// in flight) are indexed only by counters of loops marked `// @unroll`, which the host unrolls
// (backends/wgpu/unroll.rs): left as loops, an H200's driver kept all three kinds of array in
// local memory (768 bytes a thread, 242-254 registers, by its pipeline statistics).
@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
    let splits = md[M_SPLITS];
    let b = wid.z / splits;
    let split = wid.z % splits;
    let kh = wid.y;
    let hq = md[M_HQ];
    let hkv = md[M_HKV];
    let g = hq / hkv;
    let s = seq_of(b);
    let kvi = kv_of(b, s);
    let nrows = s.ql * g;
    let p0 = wid.x * BQ;
    if (p0 >= nrows) {
        return;
    }

    var lo_u = i32(s.kl);
    var hi_u = 0;
    for (var rr = 0u; rr < BQ; rr++) {
        let p = p0 + rr;
        if (p < nrows) {
            let kr = key_range(p / g, s);
            if (kr.x < kr.y) {
                lo_u = min(lo_u, kr.x);
                hi_u = max(hi_u, kr.y);
            }
        }
    }
    var start = lo_u;
    var end = hi_u;
    if (splits > 1u && hi_u > lo_u) {
        let tiles = (u32(hi_u - lo_u) + BK - 1u) / BK;
        let per = (tiles + splits - 1u) / splits;
        start = lo_u + i32(split * per * BK);
        end = min(hi_u, start + i32(per * BK));
    }

    let ty = tid / KG; // row group of the score and output blocks
    let tx = tid % KG; // key group of the score block, column phase of the output block
    let scale = bitcast<f32>(md[M_SCALE]);
    let cap = bitcast<f32>(md[M_CAP]);

    // This thread's 4 rows (score phase).
    let pr = p0 + ty * 4u;
    let r0 = row_info(pr, nrows, g, s, kh, start, end);
    let r1 = row_info(pr + 1u, nrows, g, s, kh, start, end);
    let r2 = row_info(pr + 2u, nrows, g, s, kh, start, end);
    let r3 = row_info(pr + 3u, nrows, g, s, kh, start, end);

    // Q tile, transposed: qt[d][row group] holds rows 4*rg..4*rg+3 at d.
    // A constant trip count, so that the compiler can unroll and keep several loads in flight.
    for (var it = 0u; it < (QG * D4 + WG - 1u) / WG; it++) {
        let x = tid + it * WG;
        if (x < QG * D4) {
            let rg = x % QG;
            let c = x / QG;
            let pq = p0 + rg * 4u;
            let b0 = q_vec(pq, nrows, g, s, kh, c);
            let b1 = q_vec(pq + 1u, nrows, g, s, kh, c);
            let b2 = q_vec(pq + 2u, nrows, g, s, kh, c);
            let b3 = q_vec(pq + 3u, nrows, g, s, kh, c);
            qt[(c * 4u) * QG + rg] = vec4<f32>(b0.x, b1.x, b2.x, b3.x);
            qt[(c * 4u + 1u) * QG + rg] = vec4<f32>(b0.y, b1.y, b2.y, b3.y);
            qt[(c * 4u + 2u) * QG + rg] = vec4<f32>(b0.z, b1.z, b2.z, b3.z);
            qt[(c * 4u + 3u) * QG + rg] = vec4<f32>(b0.w, b1.w, b2.w, b3.w);
        }
    }

    // Softmax state of this thread's 4 rows (the same in every thread of the row group) and its
    // part of their sums (over the keys of its key group); the output block, a row an array.
    var m = vec4<f32>(NEG);
    var l = vec4<f32>(0.0);
    var o0: array<vec4<f32>, NV>;
    var o1: array<vec4<f32>, NV>;
    var o2: array<vec4<f32>, NV>;
    var o3: array<vec4<f32>, NV>;
    // @unroll
    for (var n = 0u; n < NV; n++) {
        o0[n] = vec4<f32>(0.0);
        o1[n] = vec4<f32>(0.0);
        o2[n] = vec4<f32>(0.0);
        o3[n] = vec4<f32>(0.0);
    }

    // The K/V tiles in flight: each is loaded into registers (raw words) one phase ahead of its
    // store to workgroup memory, so the loads overlap the previous phase's arithmetic. Keys past
    // the tile's end load the last key (a clamped index) and are masked (K) or zeroed (V)
    // afterwards. (Clamping the thread's item index too, instead of the `x <` guards, made f16
    // 4% faster and f32 22% slower on an H200.)
    var kreg: array<vec4<u32>, KI * 4u>;
    var vreg: array<vec4<u32>, VI>;
    if (start < end) {
        // @unroll
        for (var it = 0u; it < KI; it++) {
            let x = tid + it * WG;
            if (x < KG * D4) {
                // @unroll
                for (var kj = 0u; kj < 4u; kj++) {
                    let j = min(start + i32((x / D4) * 4u + kj), end - 1);
                    kreg[it * 4u + kj] = raw_k((k_row(kvi, u32(j)) * hkv + kh) * D + (x % D4) * 4u);
                }
            }
        }
    }

    for (var j0 = start; j0 < end; j0 += i32(BK)) {
        workgroupBarrier(); // kv, pt and red are free (and the Q tile is written)
        // K tile, transposed and swizzled: kv[kt_at(d, key group)].
        // @unroll
        for (var it = 0u; it < KI; it++) {
            let x = tid + it * WG;
            if (x < KG * D4) {
                let kg = x / D4;
                let c = x % D4;
                let b0 = widen(kreg[it * 4u]);
                let b1 = widen(kreg[it * 4u + 1u]);
                let b2 = widen(kreg[it * 4u + 2u]);
                let b3 = widen(kreg[it * 4u + 3u]);
                kv[kt_at(c * 4u, kg)] = vec4<f32>(b0.x, b1.x, b2.x, b3.x);
                kv[kt_at(c * 4u + 1u, kg)] = vec4<f32>(b0.y, b1.y, b2.y, b3.y);
                kv[kt_at(c * 4u + 2u, kg)] = vec4<f32>(b0.z, b1.z, b2.z, b3.z);
                kv[kt_at(c * 4u + 3u, kg)] = vec4<f32>(b0.w, b1.w, b2.w, b3.w);
            }
        }
        workgroupBarrier();
        // This tile's V, in flight during q.k.
        // @unroll
        for (var it = 0u; it < VI; it++) {
            let x = tid + it * WG;
            if (x < BK * D4) {
                let j = min(j0 + i32(x / D4), end - 1);
                vreg[it] = raw_v((k_row(kvi, u32(j)) * hkv + kh) * D + (x % D4) * 4u);
            }
        }

        // 4x4 score block: rows 4ty.., keys 4tx.. (a row a vector over the 4 keys).
        var a0 = vec4<f32>(0.0);
        var a1 = vec4<f32>(0.0);
        var a2 = vec4<f32>(0.0);
        var a3 = vec4<f32>(0.0);
        for (var d = 0u; d < D; d += 4u) {
            let q0 = qt[d * QG + ty];
            let k0 = kv[kt_at(d, tx)];
            let q1 = qt[(d + 1u) * QG + ty];
            let k1 = kv[kt_at(d + 1u, tx)];
            let q2 = qt[(d + 2u) * QG + ty];
            let k2 = kv[kt_at(d + 2u, tx)];
            let q3 = qt[(d + 3u) * QG + ty];
            let k3 = kv[kt_at(d + 3u, tx)];
            a0 += q0.x * k0;
            a1 += q0.y * k0;
            a2 += q0.z * k0;
            a3 += q0.w * k0;
            a0 += q1.x * k1;
            a1 += q1.y * k1;
            a2 += q1.z * k1;
            a3 += q1.w * k1;
            a0 += q2.x * k2;
            a1 += q2.y * k2;
            a2 += q2.z * k2;
            a3 += q2.w * k2;
            a0 += q3.x * k3;
            a1 += q3.y * k3;
            a2 += q3.z * k3;
            a3 += q3.w * k3;
        }
        let jv = vec4<i32>(j0 + i32(tx * 4u)) + vec4<i32>(0, 1, 2, 3);
        let sc0 = score4(a0, jv, r0, scale, cap);
        let sc1 = score4(a1, jv, r1, scale, cap);
        let sc2 = score4(a2, jv, r2, scale, cap);
        let sc3 = score4(a3, jv, r3, scale, cap);
        let bm = vec4<f32>(max4(sc0), max4(sc1), max4(sc2), max4(sc3));
        red[tx * QG + ty] = max(bm, vec4<f32>(NEG));
        workgroupBarrier(); // the block maxima are written; K is consumed

        // V tile, row-major, into the same buffer (keys past the end zeroed).
        // @unroll
        for (var it = 0u; it < VI; it++) {
            let x = tid + it * WG;
            if (x < BK * D4) {
                let j = j0 + i32(x / D4);
                kv[x] = select(finite4(widen(vreg[it])), vec4<f32>(0.0), j >= end);
            }
        }
        // Every thread of a row group computes the same new maxima and factors; each exponentiates
        // its own 16 scores.
        var mt = vec4<f32>(NEG);
        for (var g2 = 0u; g2 < KG; g2++) {
            mt = max(mt, red[g2 * QG + ty]);
        }
        let m_new = max(m, mt);
        let al = exp(m - m_new);
        m = m_new;
        let e0 = select(vec4<f32>(0.0), exp(sc0 - vec4<f32>(m_new.x)), sc0 > vec4<f32>(MASKED));
        let e1 = select(vec4<f32>(0.0), exp(sc1 - vec4<f32>(m_new.y)), sc1 > vec4<f32>(MASKED));
        let e2 = select(vec4<f32>(0.0), exp(sc2 - vec4<f32>(m_new.z)), sc2 > vec4<f32>(MASKED));
        let e3 = select(vec4<f32>(0.0), exp(sc3 - vec4<f32>(m_new.w)), sc3 > vec4<f32>(MASKED));
        let one = vec4<f32>(1.0);
        l = l * al + vec4<f32>(dot(e0, one), dot(e1, one), dot(e2, one), dot(e3, one));
        let kb0 = tx * 4u;
        pt[pt_at(kb0, ty)] = vec4<f32>(e0.x, e1.x, e2.x, e3.x);
        pt[pt_at(kb0 + 1u, ty)] = vec4<f32>(e0.y, e1.y, e2.y, e3.y);
        pt[pt_at(kb0 + 2u, ty)] = vec4<f32>(e0.z, e1.z, e2.z, e3.z);
        pt[pt_at(kb0 + 3u, ty)] = vec4<f32>(e0.w, e1.w, e2.w, e3.w);
        workgroupBarrier(); // P and the V tile are written
        // The next tile's K, in flight during p.v.
        let jn = j0 + i32(BK);
        if (jn < end) {
            // @unroll
            for (var it = 0u; it < KI; it++) {
                let x = tid + it * WG;
                if (x < KG * D4) {
                    // @unroll
                    for (var kj = 0u; kj < 4u; kj++) {
                        let j = min(jn + i32((x / D4) * 4u + kj), end - 1);
                        kreg[it * 4u + kj] = raw_k((k_row(kvi, u32(j)) * hkv + kh) * D + (x % D4) * 4u);
                    }
                }
            }
        }

        // O block += P V: rows 4ty.., vec4 columns tx, tx + KG, ...
        // @unroll
        for (var n = 0u; n < NV; n++) {
            o0[n] *= al.x;
            o1[n] *= al.y;
            o2[n] *= al.z;
            o3[n] *= al.w;
        }
        for (var jj = 0u; jj < BK; jj++) {
            let pv = pt[pt_at(jj, ty)];
            // @unroll
            for (var n = 0u; n < NV; n++) {
                let c = tx + n * KG;
                if (c < D4) {
                    let vv = kv[jj * D4 + c];
                    o0[n] += pv.x * vv;
                    o1[n] += pv.y * vv;
                    o2[n] += pv.z * vv;
                    o3[n] += pv.w * vv;
                }
            }
        }
    }

    // The rows' sums: every key group's part, added up.
    workgroupBarrier();
    red[tx * QG + ty] = l;
    workgroupBarrier();
    var lt = vec4<f32>(0.0);
    for (var g2 = 0u; g2 < KG; g2++) {
        lt += red[g2 * QG + ty];
    }

    let ok = vec4<u32>(pr) + vec4<u32>(0u, 1u, 2u, 3u) < vec4<u32>(nrows);
    let inv = select(vec4<f32>(0.0), 1.0 / lt, lt > vec4<f32>(0.0));
    let base0 = out_base(pr, g, s, kh, split, splits);
    let base1 = out_base(pr + 1u, g, s, kh, split, splits);
    let base2 = out_base(pr + 2u, g, s, kh, split, splits);
    let base3 = out_base(pr + 3u, g, s, kh, split, splits);
    // No `break`: a loop of constant trip count unrolls, and `o` stays in registers.
    // @unroll
    for (var n = 0u; n < NV; n++) {
        let c = tx + n * KG;
        if (c < D4) {
            emit(ok.x, base0, c, o0[n] * inv.x, splits);
            emit(ok.y, base1, c, o1[n] * inv.y, splits);
            emit(ok.z, base2, c, o2[n] * inv.z, splits);
            emit(ok.w, base3, c, o3[n] * inv.w, splits);
        }
    }
    if (tx == 0u) {
        emit_lse(ok.x, pr, lt.x, m.x, b, g, s, kh, split, splits);
        emit_lse(ok.y, pr + 1u, lt.y, m.y, b, g, s, kh, split, splits);
        emit_lse(ok.z, pr + 2u, lt.z, m.z, b, g, s, kh, split, splits);
        emit_lse(ok.w, pr + 3u, lt.w, m.w, b, g, s, kh, split, splits);
    }
}
