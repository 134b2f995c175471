// Split-KV combine: merge the normalised partial outputs and partial lse of `splits` key chunks.
// One thread per (query row, query head, vec4 column): out = sum_s w_s o_s / sum_s w_s with
// w_s = exp(lse_s - max lse), lse = max + ln(sum w_s). A row no split saw gets 0 and -inf.

const D: u32 = 128u; // @spec head dim, a multiple of 4
const DT: u32 = 0u; // @spec storage dtype: 0 f32, 1 f16, 2 bf16
const WG: u32 = 64u;
const D4: u32 = D / 4u;
const NEG: f32 = -3.0e38;
// Any partial lse at or below this is an empty split (the main pass writes NEG).
const EMPTY: f32 = -1.0e38;

const M_HQ: u32 = 1u;
const M_KIND: u32 = 3u;
const M_SQ: u32 = 4u;
const M_TQ: u32 = 6u;
const M_LSE: u32 = 15u;
const M_SPLITS: u32 = 16u;

@group(0) @binding(0) var<storage, read_write> ob: array<u32>;
@group(0) @binding(1) var<storage, read_write> lseb: array<f32>;
@group(0) @binding(2) var<storage, read> md: array<u32>;
@group(0) @binding(3) var<storage, read> part_o: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read> part_lse: array<f32>;

fn to_bf16(x: f32) -> u32 {
    let b = bitcast<u32>(x);
    if ((b & 0x7fffffffu) > 0x7f800000u) {
        return (b >> 16u) | 0x40u;
    }
    return (b + 0x7fffu + ((b >> 16u) & 1u)) >> 16u;
}

fn store_o(e: u32, x: vec4<f32>) {
    if (DT == 0u) {
        ob[e] = bitcast<u32>(x.x);
        ob[e + 1u] = bitcast<u32>(x.y);
        ob[e + 2u] = bitcast<u32>(x.z);
        ob[e + 3u] = bitcast<u32>(x.w);
    } else if (DT == 1u) {
        ob[e / 2u] = pack2x16float(x.xy);
        ob[e / 2u + 1u] = pack2x16float(x.zw);
    } else {
        ob[e / 2u] = to_bf16(x.x) | (to_bf16(x.y) << 16u);
        ob[e / 2u + 1u] = to_bf16(x.z) | (to_bf16(x.w) << 16u);
    }
}

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let x = gid.x + gid.y * nwg.x * WG;
    let hq = md[M_HQ];
    let tq = md[M_TQ];
    if (x >= tq * hq * D4) {
        return;
    }
    let rh = x / D4; // row * hq + h
    let col = x % D4;
    let splits = md[M_SPLITS];
    let n = tq * hq;
    var mx = NEG;
    for (var s = 0u; s < splits; s++) {
        mx = max(mx, part_lse[s * n + rh]);
    }
    var acc = vec4<f32>(0.0);
    var wsum = 0.0;
    if (mx > EMPTY) {
        for (var s = 0u; s < splits; s++) {
            let ls = part_lse[s * n + rh];
            if (ls > EMPTY) {
                let w = exp(ls - mx);
                wsum += w;
                acc += w * part_o[(s * n + rh) * D4 + col];
            }
        }
    }
    var res = vec4<f32>(0.0);
    if (wsum > 0.0) {
        res = acc / wsum;
    }
    store_o(rh * D + col * 4u, res);
    if (col == 0u && md[M_LSE] != 0u) {
        var lv = bitcast<f32>(0xff800000u); // -inf
        if (wsum > 0.0) {
            lv = mx + log(wsum);
        }
        let row = rh / hq;
        let h = rh % hq;
        var li = h * tq + row;
        if (md[M_KIND] == 0u) {
            let sq = md[M_SQ];
            li = ((row / sq) * hq + h) * sq + row % sq;
        }
        lseb[li] = lv;
    }
}
