// Tiled flash attention with register micro-tiles (portable path: f32 arithmetic, no subgroups).
//
// The same contract, bindings and metadata as flash_attn.wgsl (read that first); the difference
// is the inner work. Each of the (BQ/4)*(BK/4) threads owns a 4x4 block of the score tile and a
// 4-row block of the output, so every workgroup-memory load feeds 4 (scores) or 4*NV (output)
// FMAs instead of one:
//   S = Q K^T:  Q and K tiles are stored transposed ([d][4 rows] vec4), outer products over d;
//   softmax:    each thread on its own 4x4 scores: the block maxima meet in workgroup memory,
//               every thread of a row group then derives the same new maxima and factors, and
//               writes its P block (transposed); the row sums are added up once at the end;
//   O += P V:   P read as [key][4 rows] vec4, V as [key][d] vec4.
// K and V share one workgroup buffer (K is consumed before V is loaded), which is what makes
// 32x32 tiles of head dim 128 fit 48 KiB.
//
// Non-finite V elements are zeroed as they are loaded: the contract lets a non-finite visible
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
fn load_k(e: u32) -> vec4<f32> {
    if (DT == 0u) {
        let a = kb[e / 2u];
        let b = kb[e / 2u + 1u];
        return unpack4(a.x, a.y, b.x, b.y);
    }
    let w = kb[e / 4u];
    return half4(w.x, w.y);
}
// Integer test, so that no finite-math assumption of a compiler can remove it.
fn finite4(x: vec4<f32>) -> vec4<f32> {
    let bad = (bitcast<vec4<u32>>(x) & vec4<u32>(0x7f800000u)) == vec4<u32>(0x7f800000u);
    return select(x, vec4<f32>(0.0), bad);
}
fn load_v(e: u32) -> vec4<f32> {
    if (DT == 0u) {
        let a = vb[e / 2u];
        let b = vb[e / 2u + 1u];
        return finite4(unpack4(a.x, a.y, b.x, b.y));
    }
    let w = vb[e / 4u];
    return finite4(half4(w.x, w.y));
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
    let has_alibi = md[M_ALIBI] != 0u;
    let shift = i32(s.kl) - i32(s.ql);

    // Visible interval and ALiBi slope of this thread's 4 rows (score phase).
    var lo4: array<i32, 4>;
    var hi4: array<i32, 4>;
    var ia4: array<i32, 4>;
    var sl4: array<f32, 4>;
    for (var ri = 0u; ri < 4u; ri++) {
        let p = p0 + ty * 4u + ri;
        var kr = vec2<i32>(0, 0);
        var slope = 0.0;
        if (p < nrows) {
            kr = key_range(p / g, s);
            if (has_alibi) {
                slope = bitcast<f32>(md[md[M_OFF_ALIBI] + kh * g + p % g]);
            }
        }
        lo4[ri] = max(kr.x, start);
        hi4[ri] = min(kr.y, end);
        ia4[ri] = i32(p / g) + shift;
        sl4[ri] = slope;
    }

    // Q tile, transposed: qt[d][row group] holds rows 4*rg..4*rg+3 at d.
    // A constant trip count, so that the compiler can unroll and keep several loads in flight.
    for (var it = 0u; it < (QG * D4 + WG - 1u) / WG; it++) {
        let x = tid + it * WG;
        if (x < QG * D4) {
            let rg = x / D4;
            let c = x % D4;
            var blk: array<vec4<f32>, 4>;
            for (var ri = 0u; ri < 4u; ri++) {
                let p = p0 + rg * 4u + ri;
                var val = vec4<f32>(0.0);
                if (p < nrows) {
                    val = load_q(((s.q0 + p / g) * hq + kh * g + p % g) * D + c * 4u);
                }
                blk[ri] = val;
            }
            qt[(c * 4u) * QG + rg] = vec4<f32>(blk[0].x, blk[1].x, blk[2].x, blk[3].x);
            qt[(c * 4u + 1u) * QG + rg] = vec4<f32>(blk[0].y, blk[1].y, blk[2].y, blk[3].y);
            qt[(c * 4u + 2u) * QG + rg] = vec4<f32>(blk[0].z, blk[1].z, blk[2].z, blk[3].z);
            qt[(c * 4u + 3u) * QG + rg] = vec4<f32>(blk[0].w, blk[1].w, blk[2].w, blk[3].w);
        }
    }

    // Softmax state of this thread's 4 rows (the same in every thread of the row group) and its
    // part of their sums (over the keys of its key group).
    var m = vec4<f32>(NEG);
    var l = vec4<f32>(0.0);
    var o: array<vec4<f32>, 4 * NV>;
    for (var c = 0u; c < 4u * NV; c++) {
        o[c] = vec4<f32>(0.0);
    }

    for (var j0 = start; j0 < end; j0 += i32(BK)) {
        workgroupBarrier(); // kv, pt and red are free (and the Q tile is written)
        // K tile, transposed: kv[d][key group].
        // A constant trip count, so that the compiler can unroll and keep several loads in flight.
        for (var it = 0u; it < (KG * D4 + WG - 1u) / WG; it++) {
            let x = tid + it * WG;
            if (x < KG * D4) {
                let kg = x / D4;
                let c = x % D4;
                var blk: array<vec4<f32>, 4>;
                for (var kj = 0u; kj < 4u; kj++) {
                    let j = j0 + i32(kg * 4u + kj);
                    var val = vec4<f32>(0.0);
                    if (j < end) {
                        val = load_k((k_row(kvi, u32(j)) * hkv + kh) * D + c * 4u);
                    }
                    blk[kj] = val;
                }
                kv[(c * 4u) * KG + kg] = vec4<f32>(blk[0].x, blk[1].x, blk[2].x, blk[3].x);
                kv[(c * 4u + 1u) * KG + kg] = vec4<f32>(blk[0].y, blk[1].y, blk[2].y, blk[3].y);
                kv[(c * 4u + 2u) * KG + kg] = vec4<f32>(blk[0].z, blk[1].z, blk[2].z, blk[3].z);
                kv[(c * 4u + 3u) * KG + kg] = vec4<f32>(blk[0].w, blk[1].w, blk[2].w, blk[3].w);
            }
        }
        workgroupBarrier();

        // 4x4 score block: rows 4ty.., keys 4tx..
        var acc: array<vec4<f32>, 4>; // acc[row] over 4 keys
        for (var ri = 0u; ri < 4u; ri++) {
            acc[ri] = vec4<f32>(0.0);
        }
        for (var d = 0u; d < D; d++) {
            let a = qt[d * QG + ty];
            let kk = kv[d * KG + tx];
            acc[0] += a.x * kk;
            acc[1] += a.y * kk;
            acc[2] += a.z * kk;
            acc[3] += a.w * kk;
        }
        var sc: array<vec4<f32>, 4>; // sc[row] over 4 keys
        var bm = vec4<f32>(NEG); // the rows' maxima over this block's keys
        for (var ri = 0u; ri < 4u; ri++) {
            var row = vec4<f32>(MASKED);
            for (var kj = 0u; kj < 4u; kj++) {
                let j = j0 + i32(tx * 4u + kj);
                var x = scale * acc[ri][kj];
                if (cap > 0.0) {
                    let y = x / cap;
                    let z = exp(-2.0 * abs(y));
                    x = cap * sign(y) * (1.0 - z) / (1.0 + z);
                }
                x -= sl4[ri] * f32(abs(ia4[ri] - j));
                // A select, not arithmetic: a NaN score of a masked key is dropped here.
                row[kj] = select(MASKED, x, j >= lo4[ri] && j < hi4[ri]);
            }
            sc[ri] = row;
            bm[ri] = max(max(row.x, row.y), max(row.z, row.w));
        }
        red[tx * QG + ty] = max(bm, vec4<f32>(NEG));
        workgroupBarrier(); // the block maxima are written; K is consumed

        // V tile, row-major, into the same buffer.
        // A constant trip count, so that the compiler can unroll and keep several loads in flight.
        for (var it = 0u; it < (BK * D4 + WG - 1u) / WG; it++) {
            let x = tid + it * WG;
            if (x < BK * D4) {
                let j = j0 + i32(x / D4);
                var val = vec4<f32>(0.0);
                if (j < end) {
                    val = load_v((k_row(kvi, u32(j)) * hkv + kh) * D + (x % D4) * 4u);
                }
                kv[x] = val;
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
        var ps = vec4<f32>(0.0);
        var pk: array<vec4<f32>, 4>; // pk[key] over 4 rows, for the transposed store
        for (var kj = 0u; kj < 4u; kj++) {
            pk[kj] = vec4<f32>(0.0);
        }
        for (var ri = 0u; ri < 4u; ri++) {
            let row = sc[ri];
            let e = select(vec4<f32>(0.0), exp(row - vec4<f32>(m_new[ri])), row > vec4<f32>(MASKED));
            ps[ri] = e.x + e.y + e.z + e.w;
            pk[0][ri] = e.x;
            pk[1][ri] = e.y;
            pk[2][ri] = e.z;
            pk[3][ri] = e.w;
        }
        l = l * al + ps;
        for (var kj = 0u; kj < 4u; kj++) {
            pt[(tx * 4u + kj) * QG + ty] = pk[kj];
        }
        workgroupBarrier(); // P and the V tile are written

        // O block += P V: rows 4ty.., vec4 columns tx, tx + KG, ...
        for (var n = 0u; n < NV; n++) {
            o[n] *= al.x;
            o[NV + n] *= al.y;
            o[2u * NV + n] *= al.z;
            o[3u * NV + n] *= al.w;
        }
        for (var jj = 0u; jj < BK; jj++) {
            let pv = pt[jj * QG + ty];
            for (var n = 0u; n < NV; n++) {
                let c = tx + n * KG;
                if (c < D4) {
                    let vv = kv[jj * D4 + c];
                    o[n] += pv.x * vv;
                    o[NV + n] += pv.y * vv;
                    o[2u * NV + n] += pv.z * vv;
                    o[3u * NV + n] += pv.w * vv;
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

    for (var ri = 0u; ri < 4u; ri++) {
        let r = ty * 4u + ri;
        let p = p0 + r;
        // No `break`: a loop of constant trip count unrolls, and `o` stays in registers.
        if (p < nrows) {
            let i = p / g;
            let h = kh * g + p % g;
            let row = s.q0 + i;
            let lr = lt[ri];
            let mr = m[ri];
            var inv = 0.0;
            if (lr > 0.0) {
                inv = 1.0 / lr;
            }
            if (splits == 1u) {
                let base = (row * hq + h) * D;
                for (var n = 0u; n < NV; n++) {
                    let c = tx + n * KG;
                    if (c < D4) {
                        store_o(base + c * 4u, o[ri * NV + n] * inv);
                    }
                }
                if (tx == 0u && md[M_LSE] != 0u) {
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
                let pi = (split * md[M_TQ] + row) * hq + h;
                for (var n = 0u; n < NV; n++) {
                    let c = tx + n * KG;
                    if (c < D4) {
                        part_o[pi * D4 + c] = o[ri * NV + n] * inv;
                    }
                }
                if (tx == 0u) {
                    var lv = NEG;
                    if (lr > 0.0) {
                        lv = mr + log(lr);
                    }
                    part_lse[pi] = lv;
                }
            }
        }
    }
}
