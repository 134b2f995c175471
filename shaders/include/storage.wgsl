// Used by flash_attn.wgsl and flash_attn_packed.wgsl (flash_attn_mt.wgsl keeps its own copy: see
// its head), included with a line `// @include storage.wgsl`: q, k, v and the output in their
// storage dtype `DT` (each file's `@spec` constant), read as raw words and widened to f32 in
// registers, or narrowed on the store.

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

// A vec4 column from its raw words: four f32 words, or two words of two halves (.zw unused).
fn widen(w: vec4<u32>) -> vec4<f32> {
    if (DT == 0u) {
        return bitcast<vec4<f32>>(w);
    }
    if (DT == 1u) {
        return vec4<f32>(unpack2x16float(w.x), unpack2x16float(w.y));
    }
    return vec4<f32>(bf16x2(w.x), bf16x2(w.y));
}
// The raw words of the vec4 column starting at element `e` (a multiple of 4) of a tensor.
fn raw_q(e: u32) -> vec4<u32> {
    if (DT == 0u) {
        return vec4<u32>(qb[e / 2u], qb[e / 2u + 1u]);
    }
    return vec4<u32>(qb[e / 4u], 0u, 0u);
}
fn raw_v(e: u32) -> vec4<u32> {
    if (DT == 0u) {
        return vec4<u32>(vb[e / 2u], vb[e / 2u + 1u]);
    }
    return vec4<u32>(vb[e / 4u], 0u, 0u);
}
// Integer test, so that no finite-math assumption of a compiler can remove it.
fn finite4(x: vec4<f32>) -> vec4<f32> {
    let bad = (bitcast<vec4<u32>>(x) & vec4<u32>(0x7f800000u)) == vec4<u32>(0x7f800000u);
    return select(x, vec4<f32>(0.0), bad);
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

