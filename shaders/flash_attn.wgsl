// Split-KV flash attention for short-query calls (decode, small chunked prefill); portable path:
// plain f32 arithmetic, no subgroup operations. flash_attn_mt.wgsl serves longer queries.
//
// One workgroup owns BQ rows of one kv head and one chunk of its keys. A row is a (query, query
// head of the group) pair, so GQA/MQA heads that share a kv head share every K/V load. Per tile
// of BK keys:
//   1. the K tile, held in registers as the raw words it is stored in, is written to workgroup
//      memory; with PF = 1 the loads of the next tile (K words and this thread's V elements) are
//      then issued into registers, so that they are in flight during this tile's arithmetic
//      (with PF = 0 they are issued at the top of the tile instead);
//   2. score phase: TPK threads share key j, each dotting the Q rows (workgroup memory) with a
//      part of the K row, so that every thread of the workgroup has work when BK < WG;
//   3. value phase: the threads form NKS key slots of D/4 threads; thread (c, slot) owns vec4
//      column c of every row's output and keys slot, slot + NKS, ...; it sums the parts of each
//      of its scores, applies scale, softcap, ALiBi and the masks, and keeps its own
//      online-softmax state (running max, sum, unnormalised output) in registers.
// Two barriers a tile (the score buffer is double-buffered). At the end the slots are merged in
// workgroup memory. No workgroup array is read before it is written.
//
// Split-KV: with `num_splits > 1` a workgroup handles one chunk of the key range and writes its
// normalised partial output and partial lse; `combine.wgsl` merges them.
//
// The host puts shaders/include/common.wgsl and storage.wgsl in place of their `@include` lines
// and specialises the lines marked `@spec` (head dim, dtype, tile sizes) before compiling.

const D: u32 = 128u; // @spec head dim, a multiple of 4
const DT: u32 = 0u; // @spec storage dtype: 0 f32, 1 f16 (two per u32), 2 bf16 (two per u32)
const BQ: u32 = 1u; // @spec rows per workgroup
const BK: u32 = 64u; // @spec keys per tile, a multiple of NKS
const NKS: u32 = 4u; // @spec key slots of the value phase
const PF: u32 = 1u; // @spec 1: the next tile's loads are issued before this tile's arithmetic
const TPK: u32 = 1u; // @spec threads that share a key's dot product in the score phase

const D4: u32 = D / 4u;
const WG: u32 = D4 * NKS;
const KPS: u32 = BK / NKS; // keys per slot per tile
// The vec4 columns each of the TPK threads of a key dots in the score phase.
const CPP: u32 = (D4 + TPK - 1u) / TPK;
// 8-byte words per vec4 column, and per K row.
const WPC: u32 = select(1u, 2u, DT == 0u);
const KW: u32 = D4 * WPC;
// Row stride of the K tile in words, padded by one so that the rows the threads of a warp read
// at once fall in different banks.
const KWS: u32 = KW + 1u;
// K words a thread moves per tile.
const KLD: u32 = (BK * KW + WG - 1u) / WG;

// @include common.wgsl
// @include storage.wgsl

// Q rows (written before the first tile), then the buffer in which the slots are merged.
var<workgroup> qs: array<vec4<f32>, BQ * D4>;
var<workgroup> ks: array<vec2<u32>, BK * KWS>;
var<workgroup> sc: array<f32, 2u * TPK * BQ * BK>;
// Per row: visible [lo, hi), aligned query position, ALiBi slope bits.
var<workgroup> rinfo: array<vec4<i32>, BQ>;
// Per (slot, row): running max and sum at the end.
var<workgroup> ml: array<vec2<f32>, NKS * BQ>;

// One thread's loads of the tile at key j0: K words tid, tid + WG, ... of the tile (row x / KW,
// word x % KW) and the raw words of vec4 column `c` of the V rows of keys slot, slot + NKS, ...;
// zeros past `end` or the tile, where no load is issued.
struct Loads {
    k: array<vec2<u32>, KLD>,
    v: array<vec4<u32>, KPS>,
}

fn tile_loads(kvi: Kv, hkv: u32, kh: u32, j0: i32, end: i32, tid: u32, slot: u32, c: u32) -> Loads {
    var ld: Loads;
    // @unroll
    for (var it = 0u; it < KLD; it++) {
        let x = tid + it * WG;
        let j = j0 + i32(x / KW);
        var w = vec2<u32>(0u);
        if (x < BK * KW && j < end) {
            w = kb[(k_row(kvi, u32(j)) * hkv + kh) * KW + x % KW];
        }
        ld.k[it] = w;
    }
    // @unroll
    for (var n = 0u; n < KPS; n++) {
        let j = j0 + i32(slot + n * NKS);
        var w = vec4<u32>(0u);
        if (j < end) {
            w = raw_v((k_row(kvi, u32(j)) * hkv + kh) * D + c * 4u);
        }
        ld.v[n] = w;
    }
    return ld;
}

// A raw score made final: scale, softcap, ALiBi, and the row's visible range (`ri`).
fn finish(raw: f32, j: i32, ri: vec4<i32>, scale: f32, cap: f32) -> f32 {
    var x = scale * raw;
    if (cap > 0.0) {
        // tanh through exp(-2|x|): finite for every input.
        let y = x / cap;
        let z = exp(-2.0 * abs(y));
        x = cap * sign(y) * (1.0 - z) / (1.0 + z);
    }
    x -= bitcast<f32>(ri.w) * f32(abs(ri.z - j));
    // A select, not arithmetic: a NaN score of a masked key is dropped here.
    return select(MASKED, x, j >= ri.x && j < ri.y);
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

    // Union of the visible key intervals of the tile's rows (computed alike by every thread).
    var lo_u = i32(s.kl);
    var hi_u = 0;
    // @unroll
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

    // Row information and the Q tile.
    for (var it = 0u; it < (BQ + WG - 1u) / WG; it++) {
        let rr = tid + it * WG;
        if (rr >= BQ) {
            continue;
        }
        let p = p0 + rr;
        var kr = vec2<i32>(0, 0);
        var slope = 0.0;
        if (p < nrows) {
            kr = key_range(p / g, s);
            if (md[M_ALIBI] != 0u) {
                slope = bitcast<f32>(md[md[M_OFF_ALIBI] + kh * g + p % g]);
            }
        }
        let ia = i32(p / g) + i32(s.kl) - i32(s.ql);
        rinfo[rr] = vec4<i32>(max(kr.x, start), min(kr.y, end), ia, bitcast<i32>(slope));
    }
    // A constant trip count, so that the compiler can unroll and keep several loads in flight.
    for (var it = 0u; it < (BQ * D4 + WG - 1u) / WG; it++) {
        let x = tid + it * WG;
        if (x < BQ * D4) {
            let pr = p0 + x / D4;
            var val = vec4<f32>(0.0);
            if (pr < nrows) {
                val = widen(raw_q(((s.q0 + pr / g) * hq + kh * g + pr % g) * D + (x % D4) * 4u));
            }
            qs[x] = val;
        }
    }

    let scale = bitcast<f32>(md[M_SCALE]);
    let cap = bitcast<f32>(md[M_CAP]);
    let c = tid % D4; // value phase: vec4 column
    let slot = tid / D4; // value phase: key slot

    var m: array<f32, BQ>;
    var l: array<f32, BQ>;
    var o: array<vec4<f32>, BQ>;
    // @unroll
    for (var r = 0u; r < BQ; r++) {
        m[r] = NEG;
        l[r] = 0.0;
        o[r] = vec4<f32>(0.0);
    }

    // This thread's loads of the next tile: issued here and after each tile's first barrier
    // (PF = 1), or at the top of each tile (PF = 0).
    var ld: Loads;
    if (PF == 1u) {
        ld = tile_loads(kvi, hkv, kh, start, end, tid, slot, c);
    }

    var buf = 0u;
    for (var j0 = start; j0 < end; j0 += i32(BK)) {
        if (PF == 0u) {
            ld = tile_loads(kvi, hkv, kh, j0, end, tid, slot, c);
        }
        // 1. The K tile into workgroup memory (the previous tile's scores were read before the
        //    last barrier); this tile's V elements kept before the next tile's loads replace them.
        // @unroll
        for (var it = 0u; it < KLD; it++) {
            let x = tid + it * WG;
            if (x < BK * KW) {
                ks[(x / KW) * KWS + x % KW] = ld.k[it];
            }
        }
        var vr = ld.v;
        workgroupBarrier(); // the K tile (and, the first time, the Q tile and rinfo) is written
        if (PF == 1u) {
            ld = tile_loads(kvi, hkv, kh, j0 + i32(BK), end, tid, slot, c);
        }

        // 2. Partial scores: part `pt` of key jj, for every row.
        let sb = buf * TPK * BQ * BK;
        for (var it = 0u; it < (BK * TPK + WG - 1u) / WG; it++) {
            let u = tid + it * WG;
            if (u < BK * TPK) {
                let jj = u % BK;
                let pt = u / BK;
                var acc: array<f32, BQ>;
                // @unroll
                for (var r = 0u; r < BQ; r++) {
                    acc[r] = 0.0;
                }
                // @unroll
                for (var ci = 0u; ci < CPP; ci++) {
                    let cc = pt * CPP + ci;
                    if (cc < D4) {
                        var kw = vec4<u32>(ks[jj * KWS + cc * WPC], 0u, 0u);
                        if (WPC == 2u) {
                            kw = vec4<u32>(kw.xy, ks[jj * KWS + cc * WPC + 1u]);
                        }
                        let kv = widen(kw);
                        // @unroll
                        for (var r = 0u; r < BQ; r++) {
                            acc[r] += dot(qs[r * D4 + cc], kv);
                        }
                    }
                }
                // @unroll
                for (var r = 0u; r < BQ; r++) {
                    sc[sb + (pt * BQ + r) * BK + jj] = acc[r];
                }
            }
        }
        workgroupBarrier(); // the scores are written; the K tile is consumed

        // 3. Online softmax and O += P V for this thread's slot and column.
        // @unroll
        for (var r = 0u; r < BQ; r++) {
            let ri = rinfo[r];
            var xs: array<f32, KPS>;
            var mt = NEG;
            // @unroll
            for (var n = 0u; n < KPS; n++) {
                let jj = slot + n * NKS;
                var raw = 0.0;
                // @unroll
                for (var pt = 0u; pt < TPK; pt++) {
                    raw += sc[sb + (pt * BQ + r) * BK + jj];
                }
                let x = finish(raw, j0 + i32(jj), ri, scale, cap);
                xs[n] = x;
                mt = max(mt, x);
            }
            let m_new = max(m[r], mt);
            let alpha = exp(m[r] - m_new);
            var acc = o[r] * alpha;
            var sum = l[r] * alpha;
            // @unroll
            for (var n = 0u; n < KPS; n++) {
                let x = xs[n];
                let pj = select(0.0, exp(x - m_new), x > MASKED);
                sum += pj;
                acc += pj * finite4(widen(vr[n]));
            }
            o[r] = acc;
            l[r] = sum;
            m[r] = m_new;
        }
        buf ^= 1u;
    }

    // Merge the slots: every slot's (m, l) to workgroup memory, then the weighted outputs are
    // summed into qs (free now) slot by slot, and the last slot writes the rows out.
    workgroupBarrier();
    if (c == 0u) {
        // @unroll
        for (var r = 0u; r < BQ; r++) {
            ml[slot * BQ + r] = vec2<f32>(m[r], l[r]);
        }
    }
    workgroupBarrier();
    var mx: array<f32, BQ>;
    var lt: array<f32, BQ>;
    // @unroll
    for (var r = 0u; r < BQ; r++) {
        var mm = NEG;
        // @unroll
        for (var t = 0u; t < NKS; t++) {
            mm = max(mm, ml[t * BQ + r].x);
        }
        var ll = 0.0;
        // @unroll
        for (var t = 0u; t < NKS; t++) {
            let e = ml[t * BQ + r];
            ll += e.y * exp(e.x - mm);
        }
        mx[r] = mm;
        lt[r] = ll;
        // This slot's share, normalised.
        var w = 0.0;
        if (ll > 0.0) {
            w = exp(m[r] - mm) / ll;
        }
        o[r] *= w;
    }
    for (var t = 0u; t + 1u < NKS; t++) {
        if (slot == t) {
            // @unroll
            for (var r = 0u; r < BQ; r++) {
                if (t == 0u) {
                    qs[r * D4 + c] = o[r];
                } else {
                    qs[r * D4 + c] += o[r];
                }
            }
        }
        workgroupBarrier();
    }
    if (slot != NKS - 1u) {
        return;
    }
    // @unroll
    for (var r = 0u; r < BQ; r++) {
        let p = p0 + r;
        // No `break`: a loop of constant trip count unrolls, and `o` stays in registers.
        if (p < nrows) {
            var res = o[r];
            if (NKS > 1u) {
                res += qs[r * D4 + c];
            }
            let i = p / g;
            let h = kh * g + p % g;
            let row = s.q0 + i;
            if (splits == 1u) {
                store_o((row * hq + h) * D + c * 4u, res);
            } else {
                part_o[((split * md[M_TQ] + row) * hq + h) * D4 + c] = res;
            }
            if (c == 0u) {
                put_lse(b, s, i, h, mx[r], lt[r], split, splits);
            }
        }
    }
}
