// Tiled flash attention (portable path: plain f32 arithmetic, no subgroup operations).
//
// One workgroup owns BQ rows of one kv head (this variant serves short-query calls, down to one
// row: decode; flash_attn_mt.wgsl serves the rest). A row is a (query, query head of the group) pair,
// so GQA/MQA heads that share a kv head share every K/V tile loaded into workgroup memory.
// K/V tiles of BK keys are streamed through workgroup memory; each row keeps its online-softmax
// state (running max m, running sum l, unnormalised output o) in registers. R threads serve a
// row: each computes BK/R of the row's scores, and owns every R-th vec4 column of its output.
// Tiles outside the union of the rows' visible key intervals are never loaded.
//
// Split-KV: with `num_splits > 1` a workgroup handles one chunk of the key range and writes
// its normalised partial output and partial lse; `combine.wgsl` merges them.
//
// The host specialises the lines marked `@spec` (head dim, dtype, tile sizes) before compiling.

const D: u32 = 128u; // @spec head dim, a multiple of 4
const DT: u32 = 0u; // @spec storage dtype: 0 f32, 1 f16 (two per u32), 2 bf16 (two per u32)
const BQ: u32 = 16u; // @spec rows per workgroup
const BK: u32 = 32u; // @spec keys per tile
const R: u32 = 4u; // @spec threads per row

const WG: u32 = BQ * R;
const D4: u32 = D / 4u;
const NV: u32 = (D4 + R - 1u) / R;
const NS: u32 = (BK + R - 1u) / R; // scores per thread per tile
// Row strides of the Q and K tiles, padded by one vec4 so that the rows a warp reads at once
// fall in different banks.
const QS: u32 = D4 + 1u;
// A finite "minus infinity": WGSL implementations may assume finite math, so the running max
// starts here, fully masked rows are detected by l == 0, and true -inf is only ever stored.
const NEG: f32 = -3.0e38;

// Header words of `md` (the metadata buffer) (the host writes them in the same order).
const M_BATCH: u32 = 0u;
const M_HQ: u32 = 1u;
const M_HKV: u32 = 2u;
const M_KIND: u32 = 3u; // 0 dense, 1 varlen, 2 paged
const M_SQ: u32 = 4u; // dense Sq
const M_SK: u32 = 5u; // dense Sk
const M_TQ: u32 = 6u; // rows of q
const M_BS: u32 = 7u; // paged block size
const M_MAXB: u32 = 8u; // paged block-table columns
const M_CAUSAL: u32 = 9u;
const M_WL: u32 = 10u; // i32, -1 = unbounded
const M_WR: u32 = 11u; // i32, -1 = unbounded
const M_CAP: u32 = 12u; // f32 bits, 0 = no softcap
const M_SCALE: u32 = 13u; // f32 bits
const M_ALIBI: u32 = 14u;
const M_LSE: u32 = 15u;
const M_SPLITS: u32 = 16u;
const M_OFF_CUQ: u32 = 17u;
const M_OFF_CUK: u32 = 18u; // cu_seqlens_k (varlen) or seq_lens (paged)
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

var<workgroup> qs: array<vec4<f32>, BQ * QS>;
var<workgroup> ks: array<vec4<f32>, BK * QS>;
var<workgroup> vs: array<vec4<f32>, BK * D4>;
var<workgroup> ss: array<f32, BQ * BK>;

fn bf16x2(w: u32) -> vec2<f32> {
    return vec2<f32>(bitcast<f32>(w << 16u), bitcast<f32>(w & 0xffff0000u));
}

// Round to nearest even; NaN stays NaN.
fn to_bf16(x: f32) -> u32 {
    let b = bitcast<u32>(x);
    if ((b & 0x7fffffffu) > 0x7f800000u) {
        return (b >> 16u) | 0x40u;
    }
    return (b + 0x7fffu + ((b >> 16u) & 1u)) >> 16u;
}

// Four elements starting at element `e` (a multiple of 4) of a packed buffer.
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
fn load_k(e: u32) -> vec4<f32> {
    if (DT == 0u) {
        let a = kb[e / 2u];
        let b = kb[e / 2u + 1u];
        return unpack4(a.x, a.y, b.x, b.y);
    }
    let w = kb[e / 4u];
    return half4(w.x, w.y);
}
fn load_v(e: u32) -> vec4<f32> {
    if (DT == 0u) {
        let a = vb[e / 2u];
        let b = vb[e / 2u + 1u];
        return unpack4(a.x, a.y, b.x, b.y);
    }
    let w = vb[e / 4u];
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

// Row of kv token `t` of sequence `b` in k/v seen as [rows, Hkv, D].
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

// [lo, hi) of keys visible to query i of the sequence; lo == hi when none.
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
    let p0 = wid.x * BQ;
    if (p0 >= s.ql * g) {
        return;
    }

    // Union of the visible key intervals of the tile's rows (computed alike by every thread).
    var lo_u = i32(s.kl);
    var hi_u = 0;
    for (var rr = 0u; rr < BQ; rr++) {
        let p = p0 + rr;
        if (p < s.ql * g) {
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

    // This thread's row.
    let r = tid / R;
    let t = tid % R;
    let p = p0 + r;
    let row_ok = p < s.ql * g;
    let i = p / g;
    let h = kh * g + p % g;
    var kr = vec2<i32>(0, 0);
    if (row_ok) {
        kr = key_range(i, s);
    }
    let lo = max(kr.x, start);
    let hi = min(kr.y, end);
    let ia = i32(i) + i32(s.kl) - i32(s.ql);
    let scale = bitcast<f32>(md[M_SCALE]);
    let cap = bitcast<f32>(md[M_CAP]);
    var slope = 0.0;
    if (md[M_ALIBI] != 0u && row_ok) {
        slope = bitcast<f32>(md[md[M_OFF_ALIBI] + h]);
    }

    // Q tile.
    // A constant trip count, so that the compiler can unroll and keep several loads in flight.
    for (var it = 0u; it < (BQ * D4 + WG - 1u) / WG; it++) {
        let x = tid + it * WG;
        if (x < BQ * D4) {
            let pr = p0 + x / D4;
            var val = vec4<f32>(0.0);
            if (pr < s.ql * g) {
                let hh = kh * g + pr % g;
                val = load_q(((s.q0 + pr / g) * hq + hh) * D + (x % D4) * 4u);
            }
            qs[(x / D4) * QS + x % D4] = val;
        }
    }

    var m = NEG;
    var l = 0.0;
    var o: array<vec4<f32>, NV>;
    for (var c = 0u; c < NV; c++) {
        o[c] = vec4<f32>(0.0);
    }

    for (var j0 = start; j0 < end; j0 += i32(BK)) {
        workgroupBarrier(); // the previous tile is consumed (and the Q tile is written)
        // A constant trip count, so that the compiler can unroll and keep several loads in flight.
        for (var it = 0u; it < (BK * D4 + WG - 1u) / WG; it++) {
            let x = tid + it * WG;
            if (x < BK * D4) {
                let j = j0 + i32(x / D4);
                var kv = vec4<f32>(0.0);
                var vv = vec4<f32>(0.0);
                if (j < end) {
                    let e = (k_row(kvi, u32(j)) * hkv + kh) * D + (x % D4) * 4u;
                    kv = load_k(e);
                    vv = load_v(e);
                }
                ks[(x / D4) * QS + x % D4] = kv;
                vs[x] = vv;
            }
        }
        workgroupBarrier();

        // Scores of this row's keys t, t+R, ...
        for (var n = 0u; n < NS; n++) {
            let jj = t + n * R;
            if (jj >= BK) {
                break;
            }
            var acc = 0.0;
            for (var c = 0u; c < D4; c++) {
                acc += dot(qs[r * QS + c], ks[jj * QS + c]);
            }
            var sc = scale * acc;
            if (cap > 0.0) {
                // tanh through exp(-2|x|): finite for every input, unlike a naive (e^2x-1)/(e^2x+1).
                let y = sc / cap;
                let z = exp(-2.0 * abs(y));
                sc = cap * sign(y) * (1.0 - z) / (1.0 + z);
            }
            sc -= slope * f32(abs(ia - (j0 + i32(jj))));
            ss[r * BK + jj] = sc;
        }
        workgroupBarrier();

        // Online softmax for this row over its visible keys of the tile.
        let a = max(lo, j0);
        let e = min(hi, j0 + i32(BK));
        if (a < e) {
            var mt = NEG;
            for (var j = a; j < e; j++) {
                mt = max(mt, ss[r * BK + u32(j - j0)]);
            }
            let m_new = max(m, mt);
            let alpha = exp(m - m_new);
            l *= alpha;
            for (var c = 0u; c < NV; c++) {
                o[c] *= alpha;
            }
            for (var j = a; j < e; j++) {
                let jj = u32(j - j0);
                let pj = exp(ss[r * BK + jj] - m_new);
                l += pj;
                // A zero weight must not multiply a value (0 * NaN is NaN).
                if (pj != 0.0) {
                    for (var c = 0u; c < NV; c++) {
                        let col = t + c * R;
                        if (col < D4) {
                            o[c] += pj * vs[jj * D4 + col];
                        }
                    }
                }
            }
            m = m_new;
        }
    }

    if (!row_ok) {
        return;
    }
    var inv = 0.0;
    if (l > 0.0) {
        inv = 1.0 / l;
    }
    let row = s.q0 + i;
    if (splits == 1u) {
        let base = (row * hq + h) * D;
        for (var c = 0u; c < NV; c++) {
            let col = t + c * R;
            if (col < D4) {
                store_o(base + col * 4u, o[c] * inv);
            }
        }
        if (t == 0u && md[M_LSE] != 0u) {
            var lv = bitcast<f32>(0xff800000u); // -inf
            if (l > 0.0) {
                lv = m + log(l);
            }
            var li = h * md[M_TQ] + row;
            if (md[M_KIND] == 0u) {
                li = (b * hq + h) * md[M_SQ] + i;
            }
            lseb[li] = lv;
        }
    } else {
        let pi = (split * md[M_TQ] + row) * hq + h;
        for (var c = 0u; c < NV; c++) {
            let col = t + c * R;
            if (col < D4) {
                part_o[pi * D4 + col] = o[c] * inv;
            }
        }
        if (t == 0u) {
            var lv = NEG;
            if (l > 0.0) {
                lv = m + log(l);
            }
            part_lse[pi] = lv;
        }
    }
}
