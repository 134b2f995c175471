// Shared by flash_attn.wgsl, flash_attn_coop.wgsl and flash_attn_packed.wgsl (flash_attn_mt.wgsl
// keeps its own copy: see its head), which include it with a line `// @include common.wgsl`
// (the host, and the naga test, put this text in that line's place before specialising): the
// metadata layout, the bindings, where a sequence's rows and kv tokens are, which keys a query
// sees, and where a row's lse goes. It reads no `@spec` constant, so it means the same in each.

// A finite "minus infinity": WGSL implementations may assume finite math, so the running max
// starts here, fully masked rows are detected by l == 0, and true -inf is only ever stored.
const NEG: f32 = -3.0e38;
const MASKED: f32 = -3.3e38; // below NEG: a score no row may use

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
    pow2: bool, // block size a power of two: shift and mask instead of a division
    sh: u32,
    bs: u32,
    bt: u32, // first block-table entry of the sequence in md
    k0: u32,
}

fn kv_of(b: u32, s: Seq) -> Kv {
    let bs = max(md[M_BS], 1u);
    return Kv(md[M_KIND] == 2u, (bs & (bs - 1u)) == 0u, countTrailingZeros(bs), bs, md[M_OFF_BT] + b * md[M_MAXB], s.k0);
}

// Row of kv token `t` in k/v seen as [rows, Hkv, D].
fn k_row(kvl: Kv, t: u32) -> u32 {
    if (kvl.paged) {
        if (kvl.pow2) {
            return (md[kvl.bt + (t >> kvl.sh)] << kvl.sh) | (t & (kvl.bs - 1u));
        }
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

// Row `i` of sequence `b` (at `s`), query head `h`: its lse, m + ln(l) with m in natural-log
// units, to the caller's lse buffer when asked for (-inf for a row that saw no key); with a split,
// to the split's partial lse (NEG for none) that combine.wgsl merges.
fn put_lse(b: u32, s: Seq, i: u32, h: u32, m: f32, l: f32, split: u32, splits: u32) {
    let hq = md[M_HQ];
    let row = s.q0 + i;
    if (splits == 1u) {
        if (md[M_LSE] != 0u) {
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
        var lv = NEG;
        if (l > 0.0) {
            lv = m + log(l);
        }
        part_lse[(split * md[M_TQ] + row) * hq + h] = lv;
    }
}
