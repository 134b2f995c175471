// Flash attention on cooperative matrices (tensor cores through Vulkan's
// VK_KHR_cooperative_matrix, Apple's simdgroup matrices through Metal), f16 only.
//
// Chosen at run time when the adapter offers 16x16x16 f16 x f16 -> f32 matrices at subgroup
// scope with subgroups of exactly 32 invocations; the portable kernels serve everything else.
//
// One workgroup owns BQ = 16 * NW consecutive queries of one query head; subgroup s owns the
// 16-row strip s. Per tile of BK keys:
//   1. the K and V tiles (prefetched into registers during the previous tile) are stored as f16
//      into one of two workgroup buffers (tiles alternate, so no barrier ends a tile); the next
//      tile's loads are issued. A tile that every row of the workgroup sees whole (a "clean"
//      tile) is stored as loaded; others have their keys past the end and V's non-finite values
//      zeroed;
//   2. S = Q K^T on the matrices (Q, scaled by scale * log2(e) once, stays in registers as A
//      matrices for the whole loop), two key blocks at a time, stored to the subgroup's scratch
//      rows;
//   3. softmax in log2 units: two invocations per row, each over half the tile's keys (one
//      shuffle joins them). The row keeps a reference max m and rescales its output only when a
//      score exceeds m + TAU (then m moves to the tile max): P = 2^(S - m) <= 2^TAU fits f16, and
//      most tiles need no rescale. When any row of a subgroup with mass moved its m, that
//      subgroup's output matrices go through its scratch rows to be scaled;
//   4. O += P V on the matrices.
// `coopLoad` reads column-major, `coopLoadT` row-major (element (r, c) at r * stride + c).
//
// Steps 2 to 4 touch only the subgroup's own rows of workgroup memory, so they are ordered by
// subgroup barriers (`sync_rows`): the subgroups of a workgroup meet once a tile, at step 1. The
// branch on a subgroup's rescale is uniform in its subgroup, which is what the cooperative
// operations in it need, but naga's uniformity analysis knows only workgroup uniformity, so this
// kernel is validated without it (spirv.rs).
//
// Every index into the workgroup and per-thread arrays is in range by construction, and the host
// compiles them without clamps (spirv.rs; 26% faster on an H100): each is a row below its
// region's rows (BQ <= 2 * BK for the Q tile in `kvs`, 16 a subgroup in `ss` and `ps`) times the
// row stride, plus a column below the row's width (D <= KS, BK <= SS and PS), or a loop counter
// below the array's constant length. Storage-buffer accesses stay clamped.
//
// The host puts shaders/include/common.wgsl (the metadata layout, bindings and masks it shares
// with flash_attn.wgsl) and runs.wgsl (which tile keys a thread loads, shared with the packed
// kernel) in place of their `@include` lines and specialises the lines marked `@spec` before compiling.

enable f16;
enable wgpu_cooperative_matrix;

const D: u32 = 128u; // @spec head dim, a multiple of 32, at most 128
const NW: u32 = 4u; // @spec subgroups of 32 per workgroup
const BK: u32 = 32u; // @spec keys per tile, a multiple of 16, at least 8 * NW
// Diagnosis only (0 in use): 2, 3, 4 stop after the first tile's scores, probabilities or output
// and write that stage's first 16 columns of every row to the output; 5 writes the row's softmax
// state and key range; 6 writes the first tile's K rows as plain loads read them from workgroup
// memory, 7 the first K^T block as the cooperative load read it (row r of the output: d = r).
const DEBUG: u32 = 0u; // @spec
const LOG2E: f32 = 1.4426950408889634;
const LN2: f32 = 0.6931471805599453;

const BQ: u32 = 16u * NW;
const WG: u32 = 32u * NW;
const D4: u32 = D / 4u;
const DM: u32 = D / 16u; // matrices along d
const KM: u32 = BK / 16u; // matrices along the keys of a tile
const KS: u32 = D + 8u; // f16 row stride of the K, V (and Q) rows in `kvs`
const SS: u32 = BK + 4u; // f32 row stride of the scratch rows
// f16 row stride of P (BK + 8 would not fit 48 KiB at D 128 with two K/V buffers).
const PS: u32 = BK + 4u;
// K/V tile buffers: tile t in buffer t % 2, so that storing the next tile needs no barrier after
// this tile's P V (2-3% faster than one buffer on an H100).
const KVB: u32 = 2u;
const LW: u32 = (BK * D4 + WG - 1u) / WG; // 8-byte words of K (and of V) a thread loads per tile
const HK: u32 = BK / 2u; // keys of one softmax invocation per tile
// Whole tiles of a dense layout are loaded from one base a thread and a constant stride (no
// per-word row arithmetic, clamp or layout test: 1.2x the kernel's speed on an H100,
// docs/PERF_NOTES.md, wgpu v17): a thread's column is fixed when WG is a multiple of D4, and
// every slot is in range when LW * WG = BK * D4.
const FAST: bool = (WG % D4) == 0u && LW * WG == BK * D4;
const RS: u32 = WG / D4; // rows apart of a thread's slots (FAST)
// With FOUR a thread's slots are runs of 4 consecutive keys (shaders/include/runs.wgsl).
const FOUR: bool = FAST && (LW % 4u) == 0u;
const TAU: f32 = 8.0;

// @include common.wgsl
// @include runs.wgsl

// K tile (rows 0..BK) then V tile (rows BK..2BK); before the first tile, the Q tile (BQ <= 2BK).
var<workgroup> kvs: array<f16, KVB * 2u * BK * KS>;
// Per subgroup 16 rows: S, then pieces of O. Then, at AL, per row this tile's rescale factor
// (at the end 1 / l); at RANGE, the workgroup's key range (bit patterns of two i32).
//
// Every workgroup value lives in one of these three arrays, on purpose: on an H200 (driver
// 580) the cooperative loads and stores read and wrote at wrong places as soon as the shader
// also declared small workgroup variables (an atomic flag, a vec2, a 64-float array), while
// plain loads and stores were right; `coop_operations_in_kernel_settings` checks it.
const AL: u32 = NW * 16u * SS;
const RANGE: u32 = AL + BQ;
// The length is kept a multiple of 4 floats: the driver places `ps` right after this array, and
// the cooperative loads of P need it 16-byte aligned. With BQ + 2 here (two floats fewer) the
// kernel's outputs were wrong on an H100 (driver 580), by the same arithmetic.
var<workgroup> ss: array<f32, NW * 16u * SS + BQ + 4u>;
// Per subgroup 16 rows: P.
var<workgroup> ps: array<f16, NW * 16u * PS>;

// Each non-finite f16 of a word (exponent all ones) zeroed. An integer test on the packed word,
// so that no finite-math assumption of a compiler can remove it; no conversion round trip.
fn finite_h2(w: u32) -> u32 {
    let lo = select(0u, 0x0000ffffu, (w & 0x00007c00u) != 0x00007c00u);
    let hi = select(0u, 0xffff0000u, (w & 0x7c000000u) != 0x7c000000u);
    return w & (lo | hi);
}

fn put4(i: u32, w: vec2<u32>) {
    // Exact: every value came from f16.
    let a = vec2<f16>(unpack2x16float(w.x));
    let b = vec2<f16>(unpack2x16float(w.y));
    kvs[i] = a.x;
    kvs[i + 1u] = a.y;
    kvs[i + 2u] = b.x;
    kvs[i + 3u] = b.y;
}

// The K word (.xy) and V word (.zw) that thread slot `x` loads for the tile starting at key `j0`.
fn kv_words(x: u32, j0: i32, end: i32, kvi: Kv, hkv: u32, kh: u32) -> vec4<u32> {
    // No branch: an index past the tile or the keys is clamped to a real word, and the caller
    // zeroes those words when it stores them. A conditional load here kept the compiler from
    // issuing a tile's loads ahead of their use (and a kernel that waited on them).
    let xc = min(x, BK * D4 - 1u);
    let j = max(min(j0 + i32(xc / D4), end - 1), 0);
    let e = (k_row(kvi, u32(j)) * hkv + kh) * D4 + xc % D4;
    return vec4<u32>(kb[e], vb[e]);
}

// The K and V words that thread `tid` loads for the tile starting at key `j`: a whole tile of a
// dense layout from one base and a constant stride (`FAST`); a whole tile of a paged layout with
// one block-table read per run of 4 keys (`FOUR`); else `kv_words` a slot.
fn tile_words(j: i32, end: i32, kvi: Kv, hkv: u32, kh: u32, tid: u32, kw: ptr<function, array<vec2<u32>, LW>>, vw: ptr<function, array<vec2<u32>, LW>>) {
    let rowst = hkv * D4; // words from one kv row to the next
    if (FAST && !kvi.paged && j + i32(BK) <= end) {
        let base = ((kvi.k0 + u32(j) + run_first(tid)) * hkv + kh) * D4 + tid % D4;
        for (var it = 0u; it < LW; it++) {
            (*kw)[it] = kb[base + run_step(it) * rowst];
            (*vw)[it] = vb[base + run_step(it) * rowst];
        }
    } else if (FOUR && kvi.paged && (kvi.bs % 4u) == 0u && (j % 4) == 0 && j + i32(BK) <= end) {
        for (var i4 = 0u; i4 < LW / 4u; i4++) {
            let t = u32(j) + run_first(tid) + run_step(i4 * 4u); // 4 keys of one block
            let base = (k_row(kvi, t) * hkv + kh) * D4 + tid % D4;
            for (var kk = 0u; kk < 4u; kk++) {
                (*kw)[i4 * 4u + kk] = kb[base + kk * rowst];
                (*vw)[i4 * 4u + kk] = vb[base + kk * rowst];
            }
        }
    } else {
        for (var it = 0u; it < LW; it++) {
            let w = kv_words(run_slot(tid, it), j, end, kvi, hkv, kh);
            (*kw)[it] = w.xy;
            (*vw)[it] = w.zw;
        }
    }
}

// The K and V words of the tile starting at key `j0` into the tile buffer at `tb`. Keys past
// `end` are zeroed (their words were loaded from a clamped index), and non-finite values of V
// too: a row that cannot see one would otherwise get 0 * NaN. A clean tile (every row of the
// workgroup sees every key) needs neither: it goes as loaded.
fn stage(tb: u32, j0: i32, clean: bool, end: i32, tid: u32, kw: ptr<function, array<vec2<u32>, LW>>, vw: ptr<function, array<vec2<u32>, LW>>) {
    if (clean) {
        for (var it = 0u; it < LW; it++) {
            let x = run_slot(tid, it);
            if (x < BK * D4) {
                let off = (x / D4) * KS + (x % D4) * 4u;
                put4(tb + off, (*kw)[it]);
                put4(tb + BK * KS + off, (*vw)[it]);
            }
        }
        return;
    }
    for (var it = 0u; it < LW; it++) {
        let x = run_slot(tid, it);
        if (x < BK * D4) {
            let off = (x / D4) * KS + (x % D4) * 4u;
            let live = j0 + i32(x / D4) < end;
            let v = vec2<u32>(finite_h2((*vw)[it].x), finite_h2((*vw)[it].y));
            put4(tb + off, select(vec2<u32>(0u), (*kw)[it], live));
            put4(tb + BK * KS + off, select(vec2<u32>(0u), v, live));
        }
    }
}

// K^T block (d block n, keys of block kb2) as a column-major B matrix: (d, j) at kvs[j * KS + d].
fn kt(tb: u32, kb2: u32, n: u32) -> coop_mat16x16<f16, B> {
    return coopLoad<coop_mat16x16<f16, B>>(&kvs[tb + kb2 * 16u * KS + n * 16u], KS);
}

// V block (keys of block kb2, d block n) as a row-major B matrix: (j, d) at kvs[(BK + j) * KS + d].
fn vt(tb: u32, kb2: u32, n: u32) -> coop_mat16x16<f16, B> {
    return coopLoadT<coop_mat16x16<f16, B>>(&kvs[tb + (BK + kb2 * 16u) * KS + n * 16u], KS);
}

// Orders the workgroup-memory accesses of the steps of a tile that touch only this subgroup's
// rows (see the header).
fn sync_rows() {
    subgroupBarrier();
}

// An output matrix with each of its 16 rows scaled by the row's factor in `al`, through the
// subgroup's scratch rows.
fn rescaled(m: coop_mat16x16<f32, C>, sg: u32, lane: u32) -> coop_mat16x16<f32, C> {
    coopStoreT(m, &ss[sg * 16u * SS], SS);
    sync_rows();
    for (var e = 0u; e < 8u; e++) {
        let idx = lane + e * 32u;
        let rr = idx / 16u;
        let at = sg * 16u * SS + rr * SS + idx % 16u;
        ss[at] = ss[at] * ss[AL + sg * 16u + rr];
    }
    sync_rows();
    let r = coopLoadT<coop_mat16x16<f32, C>>(&ss[sg * 16u * SS], SS);
    sync_rows();
    return r;
}

// Output columns 16n..16n+16 of the subgroup's 16 rows: through the scratch rows, times 1 / l
// (in `al`), to the output (or the split's partial output).
fn emit(m: coop_mat16x16<f32, C>, n: u32, sg: u32, lane: u32, i0: u32, s: Seq, h: u32, hq: u32, split: u32, splits: u32) {
    coopStoreT(m, &ss[sg * 16u * SS], SS);
    workgroupBarrier();
    for (var e = 0u; e < 2u; e++) {
        let idx = lane + e * 32u;
        let rr = idx / 4u;
        let c4 = idx % 4u;
        let at = sg * 16u * SS + rr * SS + c4 * 4u;
        let ii = i0 + sg * 16u + rr;
        if (ii < s.ql) {
            let v = vec4<f32>(ss[at], ss[at + 1u], ss[at + 2u], ss[at + 3u]) * ss[AL + sg * 16u + rr];
            let row = s.q0 + ii;
            let col4 = n * 4u + c4;
            if (splits == 1u) {
                ob[(row * hq + h) * D4 + col4] = vec2<u32>(pack2x16float(v.xy), pack2x16float(v.zw));
            } else {
                part_o[((split * md[M_TQ] + row) * hq + h) * D4 + col4] = v;
            }
        }
    }
    workgroupBarrier();
}

// Diagnosis: 8 values at column 8 * part of row `i` of the output.
fn debug_put(s: Seq, i: u32, h: u32, hq: u32, part: u32, a: vec4<f32>, b: vec4<f32>) {
    if (i < s.ql) {
        let at = ((s.q0 + i) * hq + h) * D4 + part * 2u;
        ob[at] = vec2<u32>(pack2x16float(a.xy), pack2x16float(a.zw));
        ob[at + 1u] = vec2<u32>(pack2x16float(b.xy), pack2x16float(b.zw));
    }
}

@compute @workgroup_size(WG)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) tid: u32,
) {
    // Subgroups are 32 wide (the host checks), and numbered along the invocation index.
    let sg = tid / 32u;
    let lane = tid % 32u;
    let splits = md[M_SPLITS];
    let b = wid.z / splits;
    let split = wid.z % splits;
    let h = wid.y;
    let hq = md[M_HQ];
    let hkv = md[M_HKV];
    let g = hq / hkv;
    let kh = h / g;
    let s = seq_of(b);
    let kvi = kv_of(b, s);
    let i0 = wid.x * BQ;

    // Union of the visible key intervals of the tile's rows.
    var lo_u = i32(s.kl);
    var hi_u = 0;
    var lo_x = 0;
    var hi_n = i32(s.kl);
    for (var rr = 0u; rr < BQ; rr++) {
        if (i0 + rr < s.ql) {
            let kr = key_range(i0 + rr, s);
            if (kr.x < kr.y) {
                lo_u = min(lo_u, kr.x);
                hi_u = max(hi_u, kr.y);
            }
            lo_x = max(lo_x, kr.x);
            hi_n = min(hi_n, kr.y);
        }
    }
    var st = lo_u;
    var en = hi_u;
    if (splits > 1u && hi_u > lo_u) {
        let tiles = (u32(hi_u - lo_u) + BK - 1u) / BK;
        let per = (tiles + splits - 1u) / splits;
        st = lo_u + i32(split * per * BK);
        en = min(hi_u, st + i32(per * BK));
    }
    // The cooperative operations need control flow that is uniform across the workgroup, and
    // to the shader compiler a value read from a storage buffer is not: the key range goes
    // through workgroup memory. A workgroup past the sequence's end computes nothing (and stores
    // nothing: every store below is guarded by the row).
    if (tid == 0u) {
        ss[RANGE] = bitcast<f32>(st);
        ss[RANGE + 1u] = bitcast<f32>(select(st, en, i0 < s.ql));
    }
    let start = bitcast<i32>(workgroupUniformLoad(&ss[RANGE]));
    let end = bitcast<i32>(workgroupUniformLoad(&ss[RANGE + 1u]));

    // This invocation's softmax row (of the workgroup's BQ) and half of the tile's keys.
    let r = sg * 16u + lane / 2u;
    let half = lane % 2u;
    let i = i0 + r;
    var kr = vec2<i32>(0, 0);
    var slope = 0.0;
    if (i < s.ql) {
        kr = key_range(i, s);
        if (md[M_ALIBI] != 0u) {
            slope = bitcast<f32>(md[md[M_OFF_ALIBI] + h]);
        }
    }
    let lo = max(kr.x, start);
    let hi = min(kr.y, end);
    let ia = i32(i) + i32(s.kl) - i32(s.ql);
    // Q carries scale * log2(e), so scores come out in log2 units: so do the cap, the slope and
    // the running max m (the probabilities are powers of 2).
    let cap = bitcast<f32>(md[M_CAP]) * LOG2E;
    slope *= LOG2E;
    let srow = sg * 16u * SS + (lane / 2u) * SS; // this row in the scratch
    let prow = sg * 16u * PS + (lane / 2u) * PS; // this row of P

    // Q tile, times scale * log2(e), through `kvs` into A matrices.
    let qs = bitcast<f32>(md[M_SCALE]) * LOG2E;
    for (var it = 0u; it < (BQ * D4 + WG - 1u) / WG; it++) {
        let x = tid + it * WG;
        if (x < BQ * D4) {
            let rr = x / D4;
            var w = vec2<u32>(0u);
            if (i0 + rr < s.ql) {
                w = qb[((s.q0 + i0 + rr) * hq + h) * D4 + x % D4];
            }
            // Scaled, rounded to f16 (a relative 2^-11 per element).
            let a = unpack2x16float(w.x) * qs;
            let c = unpack2x16float(w.y) * qs;
            let at = rr * KS + (x % D4) * 4u;
            kvs[at] = f16(a.x);
            kvs[at + 1u] = f16(a.y);
            kvs[at + 2u] = f16(c.x);
            kvs[at + 3u] = f16(c.y);
        }
    }
    workgroupBarrier();
    // Q (A matrices) and O (accumulators) as named matrices, not arrays of them (at most 8 each:
    // D <= 128).
    var q0 = coop_mat16x16<f16, A>();
    var q1 = coop_mat16x16<f16, A>();
    var q2 = coop_mat16x16<f16, A>();
    var q3 = coop_mat16x16<f16, A>();
    var q4 = coop_mat16x16<f16, A>();
    var q5 = coop_mat16x16<f16, A>();
    var q6 = coop_mat16x16<f16, A>();
    var q7 = coop_mat16x16<f16, A>();
    var o0 = coop_mat16x16<f32, C>();
    var o1 = coop_mat16x16<f32, C>();
    var o2 = coop_mat16x16<f32, C>();
    var o3 = coop_mat16x16<f32, C>();
    var o4 = coop_mat16x16<f32, C>();
    var o5 = coop_mat16x16<f32, C>();
    var o6 = coop_mat16x16<f32, C>();
    var o7 = coop_mat16x16<f32, C>();
    q0 = coopLoadT<coop_mat16x16<f16, A>>(&kvs[sg * 16u * KS + 0u * 16u], KS);
    if (DM > 1u) { q1 = coopLoadT<coop_mat16x16<f16, A>>(&kvs[sg * 16u * KS + 1u * 16u], KS); }
    if (DM > 2u) { q2 = coopLoadT<coop_mat16x16<f16, A>>(&kvs[sg * 16u * KS + 2u * 16u], KS); }
    if (DM > 3u) { q3 = coopLoadT<coop_mat16x16<f16, A>>(&kvs[sg * 16u * KS + 3u * 16u], KS); }
    if (DM > 4u) { q4 = coopLoadT<coop_mat16x16<f16, A>>(&kvs[sg * 16u * KS + 4u * 16u], KS); }
    if (DM > 5u) { q5 = coopLoadT<coop_mat16x16<f16, A>>(&kvs[sg * 16u * KS + 5u * 16u], KS); }
    if (DM > 6u) { q6 = coopLoadT<coop_mat16x16<f16, A>>(&kvs[sg * 16u * KS + 6u * 16u], KS); }
    if (DM > 7u) { q7 = coopLoadT<coop_mat16x16<f16, A>>(&kvs[sg * 16u * KS + 7u * 16u], KS); }
    workgroupBarrier(); // the Q tile is read before K and V overwrite it

    // K and V words of the first tile.
    var kw: array<vec2<u32>, LW>;
    var vw: array<vec2<u32>, LW>;
    tile_words(start, end, kvi, hkv, kh, tid, &kw, &vw);

    var m = NEG;
    var l = 0.0;
    var parity = 0u;
    for (var j0 = start; j0 < end; j0 += i32(BK)) {
        // This tile's K/V buffer (the previous tile's may still be read).
        let tb = parity * 2u * BK * KS;
        parity ^= 1u;
        // 1. This tile into workgroup memory; the next tile's loads in flight.
        stage(tb, j0, j0 >= lo_x && j0 + i32(BK) <= min(hi_n, end), end, tid, &kw, &vw);
        workgroupBarrier();
        let jn = j0 + i32(BK);
        tile_words(jn, end, kvi, hkv, kh, tid, &kw, &vw);

        if (DEBUG == 6u) {
            let x = (lane / 2u) * KS + half * 8u;
            debug_put(s, i, h, hq, half, vec4<f32>(f32(kvs[x]), f32(kvs[x + 1u]), f32(kvs[x + 2u]), f32(kvs[x + 3u])), vec4<f32>(f32(kvs[x + 4u]), f32(kvs[x + 5u]), f32(kvs[x + 6u]), f32(kvs[x + 7u])));
            return;
        }
        if (DEBUG == 7u) {
            coopStoreT(kt(tb, 0u, 0u), &ps[sg * 16u * PS], PS);
            workgroupBarrier();
            let x = sg * 16u * PS + (lane / 2u) * PS + half * 8u;
            debug_put(s, i, h, hq, half, vec4<f32>(f32(ps[x]), f32(ps[x + 1u]), f32(ps[x + 2u]), f32(ps[x + 3u])), vec4<f32>(f32(ps[x + 4u]), f32(ps[x + 5u]), f32(ps[x + 6u]), f32(ps[x + 7u])));
            return;
        }

        // 2. S = Q K^T. K^T as a column-major B matrix: element (d, j) at kvs[j * KS + d].
        // Key blocks in pairs, as two independent chains of products (alone no faster on an H100,
        // but 10% with the clean tiles and the log2 softmax together: docs/PERF_NOTES.md, wgpu
        // v14). With a single key block (KM 1) the second chain repeats the first, unstored.
        for (var kp = 0u; kp < KM; kp += 2u) {
            let k1 = min(kp + 1u, KM - 1u);
            var c0 = coop_mat16x16<f32, C>();
            var c1 = coop_mat16x16<f32, C>();
            c0 = coopMultiplyAdd(q0, kt(tb, kp, 0u), c0);
            c1 = coopMultiplyAdd(q0, kt(tb, k1, 0u), c1);
            if (DM > 1u) { c0 = coopMultiplyAdd(q1, kt(tb, kp, 1u), c0); c1 = coopMultiplyAdd(q1, kt(tb, k1, 1u), c1); }
            if (DM > 2u) { c0 = coopMultiplyAdd(q2, kt(tb, kp, 2u), c0); c1 = coopMultiplyAdd(q2, kt(tb, k1, 2u), c1); }
            if (DM > 3u) { c0 = coopMultiplyAdd(q3, kt(tb, kp, 3u), c0); c1 = coopMultiplyAdd(q3, kt(tb, k1, 3u), c1); }
            if (DM > 4u) { c0 = coopMultiplyAdd(q4, kt(tb, kp, 4u), c0); c1 = coopMultiplyAdd(q4, kt(tb, k1, 4u), c1); }
            if (DM > 5u) { c0 = coopMultiplyAdd(q5, kt(tb, kp, 5u), c0); c1 = coopMultiplyAdd(q5, kt(tb, k1, 5u), c1); }
            if (DM > 6u) { c0 = coopMultiplyAdd(q6, kt(tb, kp, 6u), c0); c1 = coopMultiplyAdd(q6, kt(tb, k1, 6u), c1); }
            if (DM > 7u) { c0 = coopMultiplyAdd(q7, kt(tb, kp, 7u), c0); c1 = coopMultiplyAdd(q7, kt(tb, k1, 7u), c1); }
            coopStoreT(c0, &ss[sg * 16u * SS + kp * 16u], SS);
            if (k1 > kp) {
                coopStoreT(c1, &ss[sg * 16u * SS + k1 * 16u], SS);
            }
        }
        sync_rows();
        if (DEBUG == 2u) {
            let x = srow + half * 8u;
            debug_put(s, i, h, hq, half, vec4<f32>(ss[x], ss[x + 1u], ss[x + 2u], ss[x + 3u]), vec4<f32>(ss[x + 4u], ss[x + 5u], ss[x + 6u], ss[x + 7u]));
            return;
        }

        // 3. Softmax over this invocation's half of the row, 4 keys a vector. Every loop is
        // branch-free (softcap's test is outside its loop), so that the compiler unrolls them and
        // keeps `sc` in registers.
        var sc: array<vec4<f32>, HK / 4u>;
        let jb = j0 + i32(half * HK);
        for (var n = 0u; n < HK / 4u; n++) {
            let x = srow + half * HK + n * 4u;
            sc[n] = vec4<f32>(ss[x], ss[x + 1u], ss[x + 2u], ss[x + 3u]);
        }
        if (cap > 0.0) {
            for (var n = 0u; n < HK / 4u; n++) {
                let y = sc[n] / cap;
                let z = exp(-2.0 * abs(y));
                sc[n] = cap * sign(y) * (1.0 - z) / (1.0 + z);
            }
        }
        var mt4 = vec4<f32>(NEG);
        if (slope == 0.0 && jb >= lo && jb + i32(HK) <= hi) {
            // Every key of this half row visible, no ALiBi: the scores as they are (the mask and
            // ALiBi arithmetic below, skipped here, cost 6% of the kernel's time on an H100).
            for (var n = 0u; n < HK / 4u; n++) {
                mt4 = max(mt4, sc[n]);
            }
        } else {
            for (var n = 0u; n < HK / 4u; n++) {
                let jv = vec4<i32>(jb + i32(n * 4u)) + vec4<i32>(0, 1, 2, 3);
                let x = sc[n] - slope * vec4<f32>(abs(vec4<i32>(ia) - jv));
                // A select, not arithmetic: a NaN score of a masked key is dropped here.
                let v = select(vec4<f32>(MASKED), x, (jv >= vec4<i32>(lo)) & (jv < vec4<i32>(hi)));
                sc[n] = v;
                mt4 = max(mt4, v);
            }
        }
        var mt = max(max(mt4.x, mt4.y), max(mt4.z, mt4.w));
        mt = max(mt, subgroupShuffleXor(mt, 1u));
        var alpha = 1.0;
        let lrow = l + subgroupShuffleXor(l, 1u);
        var moved = false;
        if (mt > m + TAU) {
            alpha = exp2(m - mt);
            m = mt;
            // A row with no mass yet has a zero output: nothing to rescale.
            moved = lrow > 0.0;
        }
        var sum4 = vec4<f32>(0.0);
        for (var n = 0u; n < HK / 4u; n++) {
            let x = sc[n];
            let p = select(vec4<f32>(0.0), exp2(x - vec4<f32>(m)), x > vec4<f32>(MASKED));
            sum4 += p;
            let y = prow + half * HK + n * 4u;
            ps[y] = f16(p.x);
            ps[y + 1u] = f16(p.y);
            ps[y + 2u] = f16(p.z);
            ps[y + 3u] = f16(p.w);
        }
        l = l * alpha + (sum4.x + sum4.y) + (sum4.z + sum4.w);
        if (half == 0u) {
            ss[AL + r] = alpha;
        }
        // After a barrier: P and the factors are written.
        let rescale = subgroupAny(moved);
        sync_rows();
        if (DEBUG == 3u) {
            let x = prow + half * 8u;
            debug_put(s, i, h, hq, half, vec4<f32>(f32(ps[x]), f32(ps[x + 1u]), f32(ps[x + 2u]), f32(ps[x + 3u])), vec4<f32>(f32(ps[x + 4u]), f32(ps[x + 5u]), f32(ps[x + 6u]), f32(ps[x + 7u])));
            return;
        }
        if (DEBUG == 5u) {
            let lt = l + subgroupShuffleXor(l, 1u);
            if (half == 0u) {
                debug_put(s, i, h, hq, 0u, vec4<f32>(m, lt, mt, alpha), vec4<f32>(f32(lo), f32(hi), f32(start), f32(end)));
            }
            return;
        }
        if (rescale) {
            o0 = rescaled(o0, sg, lane);
            if (DM > 1u) { o1 = rescaled(o1, sg, lane); }
            if (DM > 2u) { o2 = rescaled(o2, sg, lane); }
            if (DM > 3u) { o3 = rescaled(o3, sg, lane); }
            if (DM > 4u) { o4 = rescaled(o4, sg, lane); }
            if (DM > 5u) { o5 = rescaled(o5, sg, lane); }
            if (DM > 6u) { o6 = rescaled(o6, sg, lane); }
            if (DM > 7u) { o7 = rescaled(o7, sg, lane); }
        }

        // 4. O += P V. V as a row-major B matrix: element (j, d) at kvs[(BK + j) * KS + d].
        for (var kb2 = 0u; kb2 < KM; kb2++) {
            let pa = coopLoadT<coop_mat16x16<f16, A>>(&ps[sg * 16u * PS + kb2 * 16u], PS);
            o0 = coopMultiplyAdd(pa, vt(tb, kb2, 0u), o0);
            if (DM > 1u) { o1 = coopMultiplyAdd(pa, vt(tb, kb2, 1u), o1); }
            if (DM > 2u) { o2 = coopMultiplyAdd(pa, vt(tb, kb2, 2u), o2); }
            if (DM > 3u) { o3 = coopMultiplyAdd(pa, vt(tb, kb2, 3u), o3); }
            if (DM > 4u) { o4 = coopMultiplyAdd(pa, vt(tb, kb2, 4u), o4); }
            if (DM > 5u) { o5 = coopMultiplyAdd(pa, vt(tb, kb2, 5u), o5); }
            if (DM > 6u) { o6 = coopMultiplyAdd(pa, vt(tb, kb2, 6u), o6); }
            if (DM > 7u) { o7 = coopMultiplyAdd(pa, vt(tb, kb2, 7u), o7); }
        }
        if (DEBUG == 4u) {
            if (half == 0u) {
                ss[AL + r] = 1.0;
            }
            emit(o0, 0u, sg, lane, i0, s, h, hq, 0u, 1u);
            return;
        }
        // No barrier here: the next tile goes to the other K/V buffer, and its S and P
        // are written after its first barrier, which every reader of this tile's has passed.
    }

    // Epilogue: 1 / l per row, then O through the scratch rows, BK columns at a time.
    let lt = l + subgroupShuffleXor(l, 1u);
    if (half == 0u) {
        var inv = 0.0;
        if (lt > 0.0) {
            inv = 1.0 / lt;
        }
        ss[AL + r] = inv;
        if (i < s.ql) {
            put_lse(b, s, i, h, m * LN2, lt, split, splits);
        }
    }
    emit(o0, 0u, sg, lane, i0, s, h, hq, split, splits);
    if (DM > 1u) { emit(o1, 1u, sg, lane, i0, s, h, hq, split, splits); }
    if (DM > 2u) { emit(o2, 2u, sg, lane, i0, s, h, hq, split, splits); }
    if (DM > 3u) { emit(o3, 3u, sg, lane, i0, s, h, hq, split, splits); }
    if (DM > 4u) { emit(o4, 4u, sg, lane, i0, s, h, hq, split, splits); }
    if (DM > 5u) { emit(o5, 5u, sg, lane, i0, s, h, hq, split, splits); }
    if (DM > 6u) { emit(o6, 6u, sg, lane, i0, s, h, hq, split, splits); }
    if (DM > 7u) { emit(o7, 7u, sg, lane, i0, s, h, hq, split, splits); }
}
