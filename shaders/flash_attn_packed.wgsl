// Tiled flash attention for f16/bf16 storage with the K/V tiles kept in workgroup memory as they
// are stored (two 16-bit values a word), and 4-row register micro-tiles (portable path: f32
// arithmetic, no subgroups, no `shader-f16`).
//
// The same contract, bindings and metadata as flash_attn.wgsl (read that first; both include
// shaders/include/common.wgsl and storage.wgsl) and the same
// plan as flash_attn_mt.wgsl (read that second); what differs is how much arithmetic each
// workgroup-memory load feeds. Half-width K and V tiles leave room for 64-key tiles, and each of
// the (BQ/4)*(BK/4) threads owns
//   S = Q K^T:  a 4x4 block of the score tile (4 rows, 4 keys): per d, a 16-byte load of Q^T
//               (4 rows; 8 bytes with HALF) and an 8-byte load of K^T (4 keys, unpacked in
//               registers): 16 FMAs;
//   O += P V:   a 4-row block of the output, vec4 columns tx, tx + BK/4, ...: per key, a 16-byte
//               load of P^T (4 rows; 8 bytes with HALF) and an 8-byte load of V a column: 16
//               FMAs a column.
// Accumulation is in f32; K and V are 16-bit in workgroup memory as loaded (no rounding), and with
// HALF (the 64-row tile of 256 threads) Q^T too, and P rounded to f16. Blocks of 8 rows (twice the
// registers a thread, half the threads) ran at half the speed on an H100 (docs/PERF_NOTES.md,
// wgpu v16); the 64-row tile, the same blocks with twice the threads, 1.07-1.10x faster than 32
// rows on an H200 (v22).
//
// K is stored [d][key group] (a key group's 4 values at d in two words: keys 4g, 4g+1 | 4g+2,
// 4g+3), swizzled; V row-major [key][d/4] (two words a vec4), in the same buffer once K is
// consumed. P is f32 (f16 pairs with HALF), [key][row quad], swizzled. The rows' key intervals, positions and ALiBi
// slopes are read once into workgroup memory.
//
// Global loads run one phase ahead as in flash_attn_mt.wgsl: a tile's V words are loaded into
// registers before its q.k and stored after it (with HALF, just before the store), the next
// tile's K words before this tile's p.v.
//
// A tile that every row of the workgroup sees whole (no row's interval cuts it, no key past the
// end) stores V as loaded; any other tile zeroes non-finite V values (a row that cannot see a key
// would otherwise get 0 * NaN) and keys past the end.

const D: u32 = 128u; // @spec head dim, a multiple of 4, at most 128
const DT: u32 = 1u; // @spec storage dtype: 1 f16, 2 bf16 (two per u32)
const BQ: u32 = 32u; // @spec rows per workgroup: 16, 32 or 64
const BK: u32 = 64u; // @spec keys per tile: 32 or 64
// 1: Q^T and P^T 16-bit in workgroup memory (the 64-row tile: 256 threads fit 48 KiB at head dim
// 128; 1.07x (f16) / 1.10x (bf16) the speed of 32x64 on an H200, docs/PERF_NOTES.md, wgpu v22).
// Q^T as loaded (exact); P rounded to f16 once, the row sums adding the rounded values. With
// HALF the V words are also loaded just before their store (none live across q.k).
const HALF: u32 = 0u; // @spec
// Steps of 4 d a q.k loop iteration: 4 (2 with HALF), or the largest power of two under it that
// divides D / 4. An iteration costs about 11 issue slots besides its work on the NVIDIA Vulkan
// driver; at 32x64, 16 d an iteration ran 1.07x faster than 4 on an H100, 8 and 32 d slower than
// 16, and more keys a p.v iteration gained nothing (docs/PERF_NOTES.md, wgpu v20-v21); at 64x64,
// 8 d with the V words in place ran 1.008x (f16) / 1.00x (bf16) the speed of 16 d with V a phase
// ahead, 4 d 0.93x / 0.95x (v23).
const UQK: u32 = select(select(1u, 2u, (D / 4u) % 2u == 0u), 4u, (D / 4u) % 4u == 0u && HALF == 0u);

const RQ: u32 = BQ / 4u; // row quads (a vec4 of rows in Q^T and P^T; a thread's rows), a power of two
const KG: u32 = BK / 4u; // key groups of 4 keys, a power of two
const WG: u32 = RQ * KG;
const D4: u32 = D / 4u;
const NV: u32 = (D4 + KG - 1u) / KG; // output vec4 columns per thread
const KI: u32 = (KG * D4 + WG - 1u) / WG; // (key group, column) items of the K tile per thread
const VI: u32 = (BK * D4 + WG - 1u) / WG; // (key, column) items of the V tile per thread
// Whole tiles of a dense layout are loaded from one base a thread and a constant stride (no
// per-word row arithmetic, clamp or layout test: 1.25x the kernel's speed on an H100,
// docs/PERF_NOTES.md, wgpu v17): a thread's column is fixed when WG is a multiple of D4, and
// every item is in range when the tile's items are a multiple of WG.
const FAST: bool = (WG % D4) == 0u && ((KG * D4) % WG) == 0u && ((BK * D4) % WG) == 0u;
const RS: u32 = WG / D4; // rows apart of a thread's items (FAST)
// A K item is 4 consecutive keys; with FOUR a thread's V items are runs of 4 consecutive keys
// too (`run_slot`, shaders/include/runs.wgsl), so a whole paged tile needs one block-table read
// a run, not one a word.
const FOUR: bool = FAST && (VI % 4u) == 0u;
const VR: u32 = VI / 4u; // V runs a thread (FOUR)

// The metadata layout, bindings, sequences, paged rows and key ranges (shaders/include/common.wgsl)
// and the storage dtype's conversions (storage.wgsl), as in flash_attn.wgsl.
// @include common.wgsl
// @include storage.wgsl

var<workgroup> qt: array<vec4<f32>, D * RQ * (1u - HALF) + HALF>; // Q^T: [d][row quad], f32
var<workgroup> qh: array<vec2<u32>, D * RQ * HALF + 1u - HALF>; // Q^T: [d][row quad], 16-bit pairs (HALF)
var<workgroup> kv: array<vec2<u32>, D * KG>; // K^T as [d][key group], then V as [key][d/4]; 16-bit pairs
var<workgroup> pt: array<vec4<f32>, BK * RQ * (1u - HALF) + HALF>; // P^T: [key][row quad], f32
var<workgroup> ph: array<vec2<u32>, BK * RQ * HALF + 1u - HALF>; // P^T: [key][row quad], f16 pairs (HALF)
// Per (key group, row quad): the 4 rows' maxima over the group's 4 keys; at the end, the rows'
// partial sums.
var<workgroup> red: array<vec4<f32>, KG * RQ>;
// Per row of the tile: its visible keys [x, y) within [start, end), its query position z (for
// ALiBi) and its slope's bits w.
var<workgroup> rinfo: array<vec4<i32>, BQ>;

fn load_q(e: u32) -> vec4<f32> {
    let w = qb[e / 4u];
    return up4(w);
}
// Four f32 as f16 pairs (P^T with HALF), and back.
fn pk4(x: vec4<f32>) -> vec2<u32> {
    return vec2<u32>(pack2x16float(x.xy), pack2x16float(x.zw));
}
fn uph(w: vec2<u32>) -> vec4<f32> {
    return vec4<f32>(unpack2x16float(w.x), unpack2x16float(w.y));
}
// The raw words of vec4 `c` of row `p` of the Q tile (0 past the last row): Q^T with HALF.
fn q_raw(p: u32, nrows: u32, g: u32, s: Seq, kh: u32, c: u32) -> vec2<u32> {
    if (p >= nrows) {
        return vec2<u32>(0u);
    }
    let hq = md[M_HQ];
    return qb[(((s.q0 + p / g) * hq + kh * g + p % g) * D + c * 4u) / 4u];
}
// Four 16-bit values (two words) of the storage dtype as f32.
fn up4(w: vec2<u32>) -> vec4<f32> {
    if (DT == 1u) {
        return vec4<f32>(unpack2x16float(w.x), unpack2x16float(w.y));
    }
    return vec4<f32>(bf16x2(w.x), bf16x2(w.y));
}
// A word of two 16-bit values with each non-finite one (exponent all ones) zeroed. Integer
// tests, so that no finite-math assumption of a compiler can remove them.
fn finite2(w: u32) -> u32 {
    let e = select(0x7c00u, 0x7f80u, DT == 2u);
    let lo = select(0xffffu, 0u, (w & e) == e);
    let hi = select(0xffff0000u, 0u, ((w >> 16u) & e) == e);
    return w & (lo | hi);
}
// Two words with the low (`lo_half`) 16-bit values of `a` and `b`: a's in the low half.
fn pair_lo(a: u32, b: u32) -> u32 {
    return (a & 0xffffu) | (b << 16u);
}
fn pair_hi(a: u32, b: u32) -> u32 {
    return (a >> 16u) | (b & 0xffff0000u);
}

// One row's visible key interval within [start, end), its query position (for ALiBi) and slope's
// bits; an empty interval past the last row.
fn row_info(p: u32, nrows: u32, g: u32, s: Seq, kh: u32, start: i32, end: i32) -> vec4<i32> {
    var kr = vec2<i32>(0, 0);
    var slope = 0.0;
    if (p < nrows) {
        kr = key_range(p / g, s);
        if (md[M_ALIBI] != 0u) {
            slope = bitcast<f32>(md[md[M_OFF_ALIBI] + kh * g + p % g]);
        }
    }
    return vec4<i32>(max(kr.x, start), min(kr.y, end), i32(p / g) + i32(s.kl) - i32(s.ql), bitcast<i32>(slope));
}

// Vec4 `c` of row `p` of the Q tile (0 past the last row).
fn q_vec(p: u32, nrows: u32, g: u32, s: Seq, kh: u32, c: u32) -> vec4<f32> {
    if (p >= nrows) {
        return vec4<f32>(0.0);
    }
    let hq = md[M_HQ];
    return load_q(((s.q0 + p / g) * hq + kh * g + p % g) * D + c * 4u);
}

// One row's 4 scores (keys jv): scale, softcap, ALiBi, and MASKED outside the row's interval
// (unless the tile is clean). A select, not arithmetic: a NaN score of a masked key is dropped.
fn score4(a: vec4<f32>, jv: vec4<i32>, r: vec4<i32>, scale: f32, cap: f32, alibi: bool, clean: bool) -> vec4<f32> {
    var x = scale * a;
    if (cap > 0.0) {
        let y = x / cap;
        let z = exp(-2.0 * abs(y));
        x = cap * sign(y) * (1.0 - z) / (1.0 + z);
    }
    if (alibi) {
        x -= bitcast<f32>(r.w) * vec4<f32>(abs(vec4<i32>(r.z) - jv));
    }
    if (clean) {
        return x;
    }
    return select(vec4<f32>(MASKED), x, (jv >= vec4<i32>(r.x)) & (jv < vec4<i32>(r.y)));
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
    if (ok) {
        put_lse(b, s, p / g, kh * g + p % g, mr, lr, split, splits);
    }
}

// Where K^T's 8-byte word for (d, key group) is: the key group XOR-swizzled by the column (d / 4),
// so that the 32 threads of a store phase, which hold 32 consecutive columns of one key group,
// write 16 different bank pairs (two wavefronts, the least for 256 bytes).
fn kt_at(d: u32, kg: u32) -> u32 {
    return d * KG + (kg ^ ((d / 4u) & (KG - 1u)));
}

// Where P^T's vec4 for (key, row quad) is: the row quad XOR-swizzled by the key's group, so that
// the threads of a row quad, which store keys of different groups, write different bank groups.
fn pt_at(key: u32, rq: u32) -> u32 {
    return key * RQ + (rq ^ ((key / 4u) & (RQ - 1u)));
}

// The words of one vec4 of K (or V) at element `e`.
fn word_k(e: u32) -> vec2<u32> {
    return kb[e / 4u];
}
fn word_v(e: u32) -> vec2<u32> {
    return vb[e / 4u];
}

// A whole paged tile takes the run path: block size and first key multiples of 4.
fn runs(j: i32, end: i32, kvi: Kv) -> bool {
    return FOUR && kvi.paged && (kvi.bs % 4u) == 0u && (j % 4) == 0 && j + i32(BK) <= end;
}

// The K words of the tile starting at key `j` (4 keys of a (key group, column) item, a word each)
// into `kr`. A whole tile of a dense layout: from one base and a constant stride; of a paged
// layout: a block-table read an item. Else a row a word: keys past `end` load the last key (a
// clamped index) and are masked afterwards.
fn load_k(j: i32, end: i32, kvi: Kv, hkv: u32, kh: u32, tid: u32, kr: ptr<function, array<vec2<u32>, KI * 4u>>) {
    let rowst = hkv * D4; // words from one kv row to the next
    if (FAST && !kvi.paged && j + i32(BK) <= end) {
        let base = ((kvi.k0 + u32(j) + (tid / D4) * 4u) * hkv + kh) * D4 + tid % D4;
        // @unroll
        for (var it = 0u; it < KI; it++) {
            // @unroll
            for (var kj = 0u; kj < 4u; kj++) {
                (*kr)[it * 4u + kj] = kb[base + (it * RS * 4u + kj) * rowst];
            }
        }
    } else if (runs(j, end, kvi)) {
        // @unroll
        for (var it = 0u; it < KI; it++) {
            let t = u32(j) + (tid / D4 + it * RS) * 4u; // the item's 4 keys, in one block
            let base = (k_row(kvi, t) * hkv + kh) * D4 + tid % D4;
            // @unroll
            for (var kj = 0u; kj < 4u; kj++) {
                (*kr)[it * 4u + kj] = kb[base + kj * rowst];
            }
        }
    } else {
        // @unroll
        for (var it = 0u; it < KI; it++) {
            let x = tid + it * WG;
            if (x < KG * D4) {
                // @unroll
                for (var kj = 0u; kj < 4u; kj++) {
                    let jc = min(j + i32((x / D4) * 4u + kj), end - 1);
                    (*kr)[it * 4u + kj] = word_k((k_row(kvi, u32(jc)) * hkv + kh) * D + (x % D4) * 4u);
                }
            }
        }
    }
}

// @include runs.wgsl

// The V words of the tile starting at key `j` (item `run_slot(tid, it)` into `vr[it]`), as
// `load_k` does; keys past `end` are zeroed when stored.
fn load_v(j: i32, end: i32, kvi: Kv, hkv: u32, kh: u32, tid: u32, vr: ptr<function, array<vec2<u32>, VI>>) {
    let rowst = hkv * D4;
    if (FAST && !kvi.paged && j + i32(BK) <= end) {
        let base = ((kvi.k0 + u32(j) + run_first(tid)) * hkv + kh) * D4 + tid % D4;
        // @unroll
        for (var it = 0u; it < VI; it++) {
            (*vr)[it] = vb[base + run_step(it) * rowst];
        }
    } else if (runs(j, end, kvi)) {
        // @unroll
        for (var i4 = 0u; i4 < VR; i4++) {
            let t = u32(j) + run_first(tid) + run_step(i4 * 4u); // 4 keys of one block
            let base = (k_row(kvi, t) * hkv + kh) * D4 + tid % D4;
            // @unroll
            for (var kk = 0u; kk < 4u; kk++) {
                (*vr)[i4 * 4u + kk] = vb[base + kk * rowst];
            }
        }
    } else {
        // @unroll
        for (var it = 0u; it < VI; it++) {
            let x = run_slot(tid, it);
            if (x < BK * D4) {
                let jc = min(j + i32(x / D4), end - 1);
                (*vr)[it] = word_v((k_row(kvi, u32(jc)) * hkv + kh) * D + (x % D4) * 4u);
            }
        }
    }
}

// Per-thread arrays (the output rows, the K/V words in flight) are indexed only by counters of
// loops marked `// @unroll`, which the host unrolls (backends/wgpu/unroll.rs).
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

    // The union of the rows' intervals (the keys to visit) and their intersection (the keys
    // every row sees: tiles inside it are clean).
    var lo_u = i32(s.kl);
    var hi_u = 0;
    var lo_x = 0;
    var hi_n = i32(s.kl);
    for (var rr = 0u; rr < BQ; rr++) {
        let p = p0 + rr;
        if (p < nrows) {
            let kr = key_range(p / g, s);
            lo_x = max(lo_x, kr.x);
            hi_n = min(hi_n, kr.y);
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
    let clean_end = min(hi_n, end);

    let ty = tid / KG; // row quad of the score and output blocks
    let tx = tid % KG; // key group of the score block, column phase of the output block
    let scale = bitcast<f32>(md[M_SCALE]);
    let cap = bitcast<f32>(md[M_CAP]);
    let alibi = md[M_ALIBI] != 0u;

    // The rows' information.
    for (var rr = tid; rr < BQ; rr += WG) {
        rinfo[rr] = row_info(p0 + rr, nrows, g, s, kh, start, end);
    }
    // Q tile, transposed: qt[d][row quad] holds rows 4*rq..4*rq+3 at d.
    for (var it = 0u; it < (RQ * D4 + WG - 1u) / WG; it++) {
        let x = tid + it * WG;
        if (x < RQ * D4) {
            let rq = x % RQ;
            let c = x / RQ;
            let pq = p0 + rq * 4u;
            if (HALF == 1u) {
                let w0 = q_raw(pq, nrows, g, s, kh, c);
                let w1 = q_raw(pq + 1u, nrows, g, s, kh, c);
                let w2 = q_raw(pq + 2u, nrows, g, s, kh, c);
                let w3 = q_raw(pq + 3u, nrows, g, s, kh, c);
                qh[(c * 4u) * RQ + rq] = vec2<u32>(pair_lo(w0.x, w1.x), pair_lo(w2.x, w3.x));
                qh[(c * 4u + 1u) * RQ + rq] = vec2<u32>(pair_hi(w0.x, w1.x), pair_hi(w2.x, w3.x));
                qh[(c * 4u + 2u) * RQ + rq] = vec2<u32>(pair_lo(w0.y, w1.y), pair_lo(w2.y, w3.y));
                qh[(c * 4u + 3u) * RQ + rq] = vec2<u32>(pair_hi(w0.y, w1.y), pair_hi(w2.y, w3.y));
                continue;
            }
            let b0 = q_vec(pq, nrows, g, s, kh, c);
            let b1 = q_vec(pq + 1u, nrows, g, s, kh, c);
            let b2 = q_vec(pq + 2u, nrows, g, s, kh, c);
            let b3 = q_vec(pq + 3u, nrows, g, s, kh, c);
            qt[(c * 4u) * RQ + rq] = vec4<f32>(b0.x, b1.x, b2.x, b3.x);
            qt[(c * 4u + 1u) * RQ + rq] = vec4<f32>(b0.y, b1.y, b2.y, b3.y);
            qt[(c * 4u + 2u) * RQ + rq] = vec4<f32>(b0.z, b1.z, b2.z, b3.z);
            qt[(c * 4u + 3u) * RQ + rq] = vec4<f32>(b0.w, b1.w, b2.w, b3.w);
        }
    }

    // Softmax state of this thread's 4 rows (the same in every thread of the row quad) and its
    // part of their sums; the output block, a row an array.
    var m0 = vec4<f32>(NEG);
    var l0 = vec4<f32>(0.0);
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

    // The K/V words in flight. Keys past the tile's end load the last key (a clamped index) and
    // are masked (K) or zeroed (V) afterwards.
    var kreg: array<vec2<u32>, KI * 4u>;
    var vreg: array<vec2<u32>, VI>;
    if (start < end) {
        load_k(start, end, kvi, hkv, kh, tid, &kreg);
    }

    for (var j0 = start; j0 < end; j0 += i32(BK)) {
        let clean = j0 >= lo_x && j0 + i32(BK) <= clean_end;
        workgroupBarrier(); // kv, pt and red are free (and the Q tile and row information written)
        // K tile, transposed and swizzled: the 4 keys of a group at d in two words.
        // @unroll
        for (var it = 0u; it < KI; it++) {
            let x = tid + it * WG;
            if (x < KG * D4) {
                let kg = x / D4;
                let c = x % D4;
                let w0 = kreg[it * 4u];
                let w1 = kreg[it * 4u + 1u];
                let w2 = kreg[it * 4u + 2u];
                let w3 = kreg[it * 4u + 3u];
                kv[kt_at(c * 4u, kg)] = vec2<u32>(pair_lo(w0.x, w1.x), pair_lo(w2.x, w3.x));
                kv[kt_at(c * 4u + 1u, kg)] = vec2<u32>(pair_hi(w0.x, w1.x), pair_hi(w2.x, w3.x));
                kv[kt_at(c * 4u + 2u, kg)] = vec2<u32>(pair_lo(w0.y, w1.y), pair_lo(w2.y, w3.y));
                kv[kt_at(c * 4u + 3u, kg)] = vec2<u32>(pair_hi(w0.y, w1.y), pair_hi(w2.y, w3.y));
            }
        }
        workgroupBarrier();
        // This tile's V, in flight during q.k (but with HALF).
        if (HALF == 0u) {
            load_v(j0, end, kvi, hkv, kh, tid, &vreg);
        }

        // 4x4 score block: rows 4ty.., keys 4tx.. (a row a vector over the 4 keys).
        var a0 = vec4<f32>(0.0);
        var a1 = vec4<f32>(0.0);
        var a2 = vec4<f32>(0.0);
        var a3 = vec4<f32>(0.0);
        for (var c0 = 0u; c0 < D4; c0 += UQK) {
            // @unroll
            for (var cu = 0u; cu < UQK; cu++) {
                let c = c0 + cu;
                let kx = tx ^ (c & (KG - 1u));
                // @unroll
                for (var i = 0u; i < 4u; i++) {
                    let d = c * 4u + i;
                    var qa: vec4<f32>;
                    if (HALF == 1u) {
                        qa = up4(qh[d * RQ + ty]);
                    } else {
                        qa = qt[d * RQ + ty];
                    }
                    let k = up4(kv[d * KG + kx]);
                    a0 += qa.x * k;
                    a1 += qa.y * k;
                    a2 += qa.z * k;
                    a3 += qa.w * k;
                }
            }
        }
        let jv = vec4<i32>(j0 + i32(tx * 4u)) + vec4<i32>(0, 1, 2, 3);
        let rb = 4u * ty;
        let sc0 = score4(a0, jv, rinfo[rb], scale, cap, alibi, clean);
        let sc1 = score4(a1, jv, rinfo[rb + 1u], scale, cap, alibi, clean);
        let sc2 = score4(a2, jv, rinfo[rb + 2u], scale, cap, alibi, clean);
        let sc3 = score4(a3, jv, rinfo[rb + 3u], scale, cap, alibi, clean);
        let bm0 = vec4<f32>(max4(sc0), max4(sc1), max4(sc2), max4(sc3));
        red[tx * RQ + ty] = max(bm0, vec4<f32>(NEG));
        workgroupBarrier(); // the block maxima are written; K is consumed

        if (HALF == 1u) {
            load_v(j0, end, kvi, hkv, kh, tid, &vreg);
        }
        // V tile, row-major, into the same buffer: as loaded in a clean tile, else with keys past
        // the end and non-finite values zeroed.
        if (clean) {
            // @unroll
            for (var it = 0u; it < VI; it++) {
                let x = run_slot(tid, it);
                if (x < BK * D4) {
                    kv[x] = vreg[it];
                }
            }
        } else {
            // @unroll
            for (var it = 0u; it < VI; it++) {
                let x = run_slot(tid, it);
                if (x < BK * D4) {
                    let w = vec2<u32>(finite2(vreg[it].x), finite2(vreg[it].y));
                    kv[x] = select(w, vec2<u32>(0u), j0 + i32(x / D4) >= end);
                }
            }
        }
        // Every thread of a row quad computes the same new maxima and factors; each exponentiates
        // its own 16 scores.
        var mt0 = vec4<f32>(NEG);
        for (var g2 = 0u; g2 < KG; g2++) {
            mt0 = max(mt0, red[g2 * RQ + ty]);
        }
        let mn0 = max(m0, mt0);
        let al0 = exp(m0 - mn0);
        m0 = mn0;
        var e0 = select(vec4<f32>(0.0), exp(sc0 - vec4<f32>(mn0.x)), sc0 > vec4<f32>(MASKED));
        var e1 = select(vec4<f32>(0.0), exp(sc1 - vec4<f32>(mn0.y)), sc1 > vec4<f32>(MASKED));
        var e2 = select(vec4<f32>(0.0), exp(sc2 - vec4<f32>(mn0.z)), sc2 > vec4<f32>(MASKED));
        var e3 = select(vec4<f32>(0.0), exp(sc3 - vec4<f32>(mn0.w)), sc3 > vec4<f32>(MASKED));
        if (HALF == 1u) {
            // P rounded to f16 once: the sums below add the values p.v uses.
            e0 = uph(pk4(e0));
            e1 = uph(pk4(e1));
            e2 = uph(pk4(e2));
            e3 = uph(pk4(e3));
        }
        let one = vec4<f32>(1.0);
        l0 = l0 * al0 + vec4<f32>(dot(e0, one), dot(e1, one), dot(e2, one), dot(e3, one));
        let kb0 = tx * 4u;
        if (HALF == 1u) {
            ph[pt_at(kb0, ty)] = pk4(vec4<f32>(e0.x, e1.x, e2.x, e3.x));
            ph[pt_at(kb0 + 1u, ty)] = pk4(vec4<f32>(e0.y, e1.y, e2.y, e3.y));
            ph[pt_at(kb0 + 2u, ty)] = pk4(vec4<f32>(e0.z, e1.z, e2.z, e3.z));
            ph[pt_at(kb0 + 3u, ty)] = pk4(vec4<f32>(e0.w, e1.w, e2.w, e3.w));
        } else {
            pt[pt_at(kb0, ty)] = vec4<f32>(e0.x, e1.x, e2.x, e3.x);
            pt[pt_at(kb0 + 1u, ty)] = vec4<f32>(e0.y, e1.y, e2.y, e3.y);
            pt[pt_at(kb0 + 2u, ty)] = vec4<f32>(e0.z, e1.z, e2.z, e3.z);
            pt[pt_at(kb0 + 3u, ty)] = vec4<f32>(e0.w, e1.w, e2.w, e3.w);
        }
        workgroupBarrier(); // P and the V tile are written
        // The next tile's K, in flight during p.v.
        let jn = j0 + i32(BK);
        if (jn < end) {
            load_k(jn, end, kvi, hkv, kh, tid, &kreg);
        }

        // O block += P V: rows 4ty.., vec4 columns tx, tx + KG, ...
        // @unroll
        for (var n = 0u; n < NV; n++) {
            o0[n] *= al0.x;
            o1[n] *= al0.y;
            o2[n] *= al0.z;
            o3[n] *= al0.w;
        }
        // Unrolled by the driver (the host's unrolling would write BK copies of the body): 1.04x
        // (bf16) / 1.005x (f16) on an H100 at 64x64 (docs/PERF_NOTES.md, wgpu v27).
        // @driver-unroll
        for (var jj = 0u; jj < BK; jj++) {
            var pa: vec4<f32>;
            if (HALF == 1u) {
                pa = uph(ph[pt_at(jj, ty)]);
            } else {
                pa = pt[pt_at(jj, ty)];
            }
            // @unroll
            for (var n = 0u; n < NV; n++) {
                let c = tx + n * KG;
                if (c < D4) {
                    let vv = up4(kv[jj * D4 + c]);
                    o0[n] += pa.x * vv;
                    o1[n] += pa.y * vv;
                    o2[n] += pa.z * vv;
                    o3[n] += pa.w * vv;
                }
            }
        }
    }

    // The rows' sums: every key group's part, added up.
    workgroupBarrier();
    red[tx * RQ + ty] = l0;
    workgroupBarrier();
    var lt0 = vec4<f32>(0.0);
    for (var g2 = 0u; g2 < KG; g2++) {
        lt0 += red[g2 * RQ + ty];
    }

    let pr = p0 + 4u * ty;
    let ok0 = vec4<u32>(pr) + vec4<u32>(0u, 1u, 2u, 3u) < vec4<u32>(nrows);
    let inv0 = select(vec4<f32>(0.0), 1.0 / lt0, lt0 > vec4<f32>(0.0));
    let base0 = out_base(pr, g, s, kh, split, splits);
    let base1 = out_base(pr + 1u, g, s, kh, split, splits);
    let base2 = out_base(pr + 2u, g, s, kh, split, splits);
    let base3 = out_base(pr + 3u, g, s, kh, split, splits);
    // @unroll
    for (var n = 0u; n < NV; n++) {
        let c = tx + n * KG;
        if (c < D4) {
            emit(ok0.x, base0, c, o0[n] * inv0.x, splits);
            emit(ok0.y, base1, c, o1[n] * inv0.y, splits);
            emit(ok0.z, base2, c, o2[n] * inv0.z, splits);
            emit(ok0.w, base3, c, o3[n] * inv0.w, splits);
        }
    }
    if (tx == 0u) {
        emit_lse(ok0.x, pr, lt0.x, m0.x, b, g, s, kh, split, splits);
        emit_lse(ok0.y, pr + 1u, lt0.y, m0.y, b, g, s, kh, split, splits);
        emit_lse(ok0.z, pr + 2u, lt0.z, m0.z, b, g, s, kh, split, splits);
        emit_lse(ok0.w, pr + 3u, lt0.w, m0.w, b, g, s, kh, split, splits);
    }
}
