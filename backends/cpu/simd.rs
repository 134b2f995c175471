//! The vector operations the kernel is written in, one implementation per instruction set:
//! AVX-512 (16 lanes), AVX2 + FMA + F16C (8 lanes), and a portable 8-lane array that the compiler
//! maps to NEON on aarch64 and SSE2 elsewhere. The kernel is generic over [`Simd`] and is
//! instantiated inside `#[target_feature]` entry points, so each set is chosen at run time.
//!
//! Every method is `unsafe`: it may only run where its instruction set was detected, and the
//! pointer ones read or write `LANES` elements.

#![allow(clippy::missing_safety_doc)]

use half::slice::HalfFloatSliceExt;

/// Coefficients of 2^f = e^(f ln 2) on [-0.5, 0.5] (Taylor to degree 6: relative error < 2e-7).
const C: [f32; 7] =
    [1.0, std::f32::consts::LN_2, 0.240_226_5, 0.055_504_11, 0.009_618_129, 0.001_333_355_8, 0.000_154_035_3];

/// A vector of f32 lanes and what the kernel does with it.
pub(crate) trait Simd: Copy + Send + Sync + 'static {
    /// f32 lanes per vector.
    const LANES: usize;
    /// Keys per q·kᵀ register tile and query rows per p·v register tile (each times 2 vectors).
    const MR: usize;
    /// The vector.
    type V: Copy;
    unsafe fn zero() -> Self::V;
    unsafe fn splat(x: f32) -> Self::V;
    unsafe fn load(p: *const f32) -> Self::V;
    unsafe fn store(p: *mut f32, v: Self::V);
    /// `a * b + c`, fused.
    unsafe fn fma(a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    unsafe fn add(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn mul(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn sub(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn max(a: Self::V, b: Self::V) -> Self::V;
    /// 2^x; exactly 0 for x below -126 (and for -inf).
    unsafe fn exp2(x: Self::V) -> Self::V;
    /// `LANES` f16 values widened.
    unsafe fn load_f16(p: *const u16) -> Self::V;
    /// `LANES` bf16 values widened.
    unsafe fn load_bf16(p: *const u16) -> Self::V;
    /// `LANES` values narrowed to f16 bits at `p`, rounded to nearest even (as `half`'s
    /// `f16::from_f32`).
    unsafe fn store_f16(p: *mut u16, v: Self::V);
    /// `LANES` values narrowed to bf16 bits at `p`, rounded to nearest even, NaN kept quiet (as
    /// `half`'s `bf16::from_f32`).
    unsafe fn store_bf16(p: *mut u16, v: Self::V);
    /// Lanes with `a <= j < e` keep `t`, the others become -inf.
    unsafe fn mask_range(t: Self::V, j: f32, a: Self::V, e: Self::V) -> Self::V;
    /// -inf lanes become 0.
    unsafe fn neg_inf_to_zero(x: Self::V) -> Self::V;
    /// The sum of the lanes.
    #[inline(always)]
    unsafe fn reduce_add(x: Self::V) -> f32 {
        let mut a = [0.0f32; 16];
        // SAFETY: `a` holds 16 >= LANES f32; the instruction set is the caller's promise.
        unsafe { Self::store(a.as_mut_ptr(), x) };
        a[..Self::LANES].iter().sum()
    }
    /// Hint that the cache line at `p` is read soon (never faults). Into L2, not L1: a tile ahead is
    /// 256 KiB in decode, and L2 misses have more slots in flight than L1 misses.
    #[inline(always)]
    unsafe fn prefetch(p: *const u8) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: a prefetch is a hint and never faults, whatever the address.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(p as *const i8)
        };
        #[cfg(not(target_arch = "x86_64"))]
        let _ = p;
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) use x86::{Avx2, Avx512};

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{Simd, C};

    /// AVX-512F (with F16C for f16 widening, implied by every AVX-512 CPU).
    #[derive(Clone, Copy)]
    pub(crate) struct Avx512;

    impl Simd for Avx512 {
        const LANES: usize = 16;
        const MR: usize = 8;
        type V = __m512;
        #[inline(always)]
        unsafe fn zero() -> __m512 {
            _mm512_setzero_ps()
        }
        #[inline(always)]
        unsafe fn splat(x: f32) -> __m512 {
            _mm512_set1_ps(x)
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> __m512 {
            // SAFETY: the caller guarantees 16 readable f32 at `p` and AVX-512F.
            unsafe { _mm512_loadu_ps(p) }
        }
        #[inline(always)]
        unsafe fn store(p: *mut f32, v: __m512) {
            // SAFETY: the caller guarantees 16 writable f32 at `p` and AVX-512F.
            unsafe { _mm512_storeu_ps(p, v) }
        }
        #[inline(always)]
        unsafe fn fma(a: __m512, b: __m512, c: __m512) -> __m512 {
            _mm512_fmadd_ps(a, b, c)
        }
        #[inline(always)]
        unsafe fn add(a: __m512, b: __m512) -> __m512 {
            _mm512_add_ps(a, b)
        }
        #[inline(always)]
        unsafe fn mul(a: __m512, b: __m512) -> __m512 {
            _mm512_mul_ps(a, b)
        }
        #[inline(always)]
        unsafe fn sub(a: __m512, b: __m512) -> __m512 {
            _mm512_sub_ps(a, b)
        }
        #[inline(always)]
        unsafe fn max(a: __m512, b: __m512) -> __m512 {
            _mm512_max_ps(a, b)
        }
        #[inline(always)]
        unsafe fn exp2(x: __m512) -> __m512 {
            // Clamp so that -inf gives 2^-200 (flushed to 0 by scalef) instead of NaN.
            let x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-200.0)), _mm512_set1_ps(128.0));
            let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(x);
            let f = _mm512_sub_ps(x, n);
            let mut p = _mm512_set1_ps(C[6]);
            for &c in C[..6].iter().rev() {
                p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
            }
            _mm512_scalef_ps(p, n)
        }
        #[inline(always)]
        unsafe fn load_f16(p: *const u16) -> __m512 {
            // SAFETY: the caller guarantees 16 readable u16 at `p` and AVX-512F.
            unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)) }
        }
        #[inline(always)]
        unsafe fn load_bf16(p: *const u16) -> __m512 {
            // SAFETY: the caller guarantees 16 readable u16 at `p` and AVX-512F.
            let h = unsafe { _mm256_loadu_si256(p as *const __m256i) };
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
        }
        #[inline(always)]
        unsafe fn store_f16(p: *mut u16, v: __m512) {
            let h = _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v);
            // SAFETY: the caller guarantees 16 writable u16 at `p` and AVX-512F.
            unsafe { _mm256_storeu_si256(p as *mut __m256i, h) }
        }
        #[inline(always)]
        unsafe fn store_bf16(p: *mut u16, v: __m512) {
            let x = _mm512_castps_si512(v);
            // Round to nearest even: add 0x7fff and the kept part's lowest bit, keep the top half.
            let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(x), _mm512_set1_epi32(1));
            let r = _mm512_srli_epi32::<16>(_mm512_add_epi32(_mm512_add_epi32(x, _mm512_set1_epi32(0x7fff)), lsb));
            // NaN: the top half with the quiet bit set.
            let nan = _mm512_cmpgt_epi32_mask(
                _mm512_and_si512(x, _mm512_set1_epi32(0x7fff_ffff)),
                _mm512_set1_epi32(0x7f80_0000),
            );
            let q = _mm512_or_si512(_mm512_srli_epi32::<16>(x), _mm512_set1_epi32(0x40));
            let h = _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, r, q));
            // SAFETY: the caller guarantees 16 writable u16 at `p` and AVX-512F.
            unsafe { _mm256_storeu_si256(p as *mut __m256i, h) }
        }
        #[inline(always)]
        unsafe fn mask_range(t: __m512, j: f32, a: __m512, e: __m512) -> __m512 {
            let j = _mm512_set1_ps(j);
            let k = _mm512_cmp_ps_mask::<_CMP_LE_OQ>(a, j) & _mm512_cmp_ps_mask::<_CMP_LT_OQ>(j, e);
            _mm512_mask_blend_ps(k, _mm512_set1_ps(f32::NEG_INFINITY), t)
        }
        #[inline(always)]
        unsafe fn neg_inf_to_zero(x: __m512) -> __m512 {
            let k = _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(x, _mm512_set1_ps(f32::NEG_INFINITY));
            _mm512_mask_blend_ps(k, x, _mm512_setzero_ps())
        }
        #[inline(always)]
        unsafe fn reduce_add(x: __m512) -> f32 {
            _mm512_reduce_add_ps(x)
        }
    }

    /// AVX2 with FMA and F16C.
    #[derive(Clone, Copy)]
    pub(crate) struct Avx2;

    impl Simd for Avx2 {
        const LANES: usize = 8;
        const MR: usize = 4;
        type V = __m256;
        #[inline(always)]
        unsafe fn zero() -> __m256 {
            _mm256_setzero_ps()
        }
        #[inline(always)]
        unsafe fn splat(x: f32) -> __m256 {
            _mm256_set1_ps(x)
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> __m256 {
            // SAFETY: the caller guarantees 8 readable f32 at `p` and AVX.
            unsafe { _mm256_loadu_ps(p) }
        }
        #[inline(always)]
        unsafe fn store(p: *mut f32, v: __m256) {
            // SAFETY: the caller guarantees 8 writable f32 at `p` and AVX.
            unsafe { _mm256_storeu_ps(p, v) }
        }
        #[inline(always)]
        unsafe fn fma(a: __m256, b: __m256, c: __m256) -> __m256 {
            _mm256_fmadd_ps(a, b, c)
        }
        #[inline(always)]
        unsafe fn add(a: __m256, b: __m256) -> __m256 {
            _mm256_add_ps(a, b)
        }
        #[inline(always)]
        unsafe fn mul(a: __m256, b: __m256) -> __m256 {
            _mm256_mul_ps(a, b)
        }
        #[inline(always)]
        unsafe fn sub(a: __m256, b: __m256) -> __m256 {
            _mm256_sub_ps(a, b)
        }
        #[inline(always)]
        unsafe fn max(a: __m256, b: __m256) -> __m256 {
            _mm256_max_ps(a, b)
        }
        #[inline(always)]
        unsafe fn exp2(x: __m256) -> __m256 {
            let keep = _mm256_cmp_ps::<_CMP_GE_OQ>(x, _mm256_set1_ps(-126.0));
            let xc = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-126.0)), _mm256_set1_ps(127.0));
            let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(xc);
            let f = _mm256_sub_ps(xc, n);
            let mut p = _mm256_set1_ps(C[6]);
            for &c in C[..6].iter().rev() {
                p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(c));
            }
            let e = _mm256_slli_epi32::<23>(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)));
            _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), keep)
        }
        #[inline(always)]
        unsafe fn load_f16(p: *const u16) -> __m256 {
            // SAFETY: the caller guarantees 8 readable u16 at `p` and F16C.
            unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)) }
        }
        #[inline(always)]
        unsafe fn load_bf16(p: *const u16) -> __m256 {
            // SAFETY: the caller guarantees 8 readable u16 at `p` and AVX2.
            let h = unsafe { _mm_loadu_si128(p as *const __m128i) };
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
        }
        #[inline(always)]
        unsafe fn store_f16(p: *mut u16, v: __m256) {
            let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v);
            // SAFETY: the caller guarantees 8 writable u16 at `p` and F16C.
            unsafe { _mm_storeu_si128(p as *mut __m128i, h) }
        }
        #[inline(always)]
        unsafe fn store_bf16(p: *mut u16, v: __m256) {
            let x = _mm256_castps_si256(v);
            // As Avx512's: round to nearest even, NaN quiet.
            let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(x), _mm256_set1_epi32(1));
            let r = _mm256_srli_epi32::<16>(_mm256_add_epi32(_mm256_add_epi32(x, _mm256_set1_epi32(0x7fff)), lsb));
            let nan =
                _mm256_cmpgt_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x7fff_ffff)), _mm256_set1_epi32(0x7f80_0000));
            let q = _mm256_or_si256(_mm256_srli_epi32::<16>(x), _mm256_set1_epi32(0x40));
            let w = _mm256_blendv_epi8(r, q, nan);
            // Every lane is at most 0xffff, so the unsigned saturating pack keeps it.
            let h = _mm_packus_epi32(_mm256_castsi256_si128(w), _mm256_extracti128_si256::<1>(w));
            // SAFETY: the caller guarantees 8 writable u16 at `p` and AVX2.
            unsafe { _mm_storeu_si128(p as *mut __m128i, h) }
        }
        #[inline(always)]
        unsafe fn mask_range(t: __m256, j: f32, a: __m256, e: __m256) -> __m256 {
            let j = _mm256_set1_ps(j);
            let k = _mm256_and_ps(_mm256_cmp_ps::<_CMP_LE_OQ>(a, j), _mm256_cmp_ps::<_CMP_LT_OQ>(j, e));
            _mm256_blendv_ps(_mm256_set1_ps(f32::NEG_INFINITY), t, k)
        }
        #[inline(always)]
        unsafe fn neg_inf_to_zero(x: __m256) -> __m256 {
            let k = _mm256_cmp_ps::<_CMP_EQ_OQ>(x, _mm256_set1_ps(f32::NEG_INFINITY));
            _mm256_blendv_ps(x, _mm256_setzero_ps(), k)
        }
    }
}

/// Eight f32 lanes as an array: the compiler vectorises the lane loops (NEON on aarch64).
#[derive(Clone, Copy)]
pub(crate) struct Portable;

type P8 = [f32; 8];

/// Eight 16-bit values written by `narrow` (`half`'s slice conversion, with its own run-time
/// choice of instructions, e.g. on aarch64) into registers, then stored at `p` with one unaligned
/// write: the `Simd` trait promises 8 writable u16 at `p`, not their alignment (the loads read
/// unaligned too).
///
/// # Safety
/// 8 writable u16 at `p`, and `T` a 16-bit pattern (checked at compile time).
#[inline(always)]
unsafe fn store_narrowed<T: Copy>(p: *mut u16, zero: T, narrow: impl FnOnce(&mut [T])) {
    const { assert!(std::mem::size_of::<T>() == 2) };
    let mut h = [zero; 8];
    narrow(&mut h);
    // SAFETY: the caller guarantees 8 writable u16 at `p`; `[T; 8]` is 16 bytes (asserted above).
    unsafe { p.cast::<[T; 8]>().write_unaligned(h) };
}

#[inline(always)]
fn map2(a: P8, b: P8, f: impl Fn(f32, f32) -> f32) -> P8 {
    let mut r = [0.0; 8];
    for i in 0..8 {
        r[i] = f(a[i], b[i]);
    }
    r
}

impl Simd for Portable {
    const LANES: usize = 8;
    const MR: usize = 4;
    type V = P8;
    #[inline(always)]
    unsafe fn zero() -> P8 {
        [0.0; 8]
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> P8 {
        [x; 8]
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> P8 {
        // SAFETY: the caller guarantees 8 readable f32 at `p`.
        unsafe { (p as *const P8).read_unaligned() }
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: P8) {
        // SAFETY: the caller guarantees 8 writable f32 at `p`.
        unsafe { (p as *mut P8).write_unaligned(v) }
    }
    #[inline(always)]
    unsafe fn fma(a: P8, b: P8, c: P8) -> P8 {
        let mut r = [0.0; 8];
        for i in 0..8 {
            // Fused where the target has it natively (NEON); elsewhere a libm `fmaf` call would
            // be far slower than a rounded multiply-add.
            #[cfg(target_arch = "aarch64")]
            {
                r[i] = a[i].mul_add(b[i], c[i]);
            }
            #[cfg(not(target_arch = "aarch64"))]
            {
                r[i] = a[i] * b[i] + c[i];
            }
        }
        r
    }
    #[inline(always)]
    unsafe fn add(a: P8, b: P8) -> P8 {
        map2(a, b, |x, y| x + y)
    }
    #[inline(always)]
    unsafe fn mul(a: P8, b: P8) -> P8 {
        map2(a, b, |x, y| x * y)
    }
    #[inline(always)]
    unsafe fn sub(a: P8, b: P8) -> P8 {
        map2(a, b, |x, y| x - y)
    }
    #[inline(always)]
    unsafe fn max(a: P8, b: P8) -> P8 {
        map2(a, b, f32::max)
    }
    #[inline(always)]
    unsafe fn exp2(x: P8) -> P8 {
        let mut r = [0.0; 8];
        for i in 0..8 {
            let xc = x[i].clamp(-126.0, 127.0);
            // Round to nearest through the 1.5 * 2^23 trick (|xc| < 2^22).
            let n = (xc + 12_582_912.0) - 12_582_912.0;
            let f = xc - n;
            let mut p = C[6];
            for &c in C[..6].iter().rev() {
                p = p * f + c;
            }
            let e = f32::from_bits(((n as i32 + 127) as u32) << 23);
            r[i] = if x[i] >= -126.0 { p * e } else { 0.0 };
        }
        r
    }
    #[inline(always)]
    unsafe fn load_f16(p: *const u16) -> P8 {
        let mut r = [0.0; 8];
        for (i, x) in r.iter_mut().enumerate() {
            // SAFETY: the caller guarantees 8 readable u16 at `p`.
            *x = half::f16::from_bits(unsafe { p.add(i).read_unaligned() }).to_f32();
        }
        r
    }
    #[inline(always)]
    unsafe fn load_bf16(p: *const u16) -> P8 {
        let mut r = [0.0; 8];
        for (i, x) in r.iter_mut().enumerate() {
            // SAFETY: the caller guarantees 8 readable u16 at `p`.
            *x = f32::from_bits((unsafe { p.add(i).read_unaligned() } as u32) << 16);
        }
        r
    }
    #[inline(always)]
    unsafe fn store_f16(p: *mut u16, v: P8) {
        // SAFETY: the caller guarantees 8 writable u16 at `p`; f16 is a u16 bit pattern.
        unsafe { store_narrowed(p, half::f16::ZERO, |h: &mut [half::f16]| h.convert_from_f32_slice(&v)) }
    }
    #[inline(always)]
    unsafe fn store_bf16(p: *mut u16, v: P8) {
        // SAFETY: the caller guarantees 8 writable u16 at `p`; bf16 is a u16 bit pattern.
        unsafe { store_narrowed(p, half::bf16::ZERO, |h: &mut [half::bf16]| h.convert_from_f32_slice(&v)) }
    }
    #[inline(always)]
    unsafe fn mask_range(t: P8, j: f32, a: P8, e: P8) -> P8 {
        let mut r = [0.0; 8];
        for i in 0..8 {
            r[i] = if a[i] <= j && j < e[i] { t[i] } else { f32::NEG_INFINITY };
        }
        r
    }
    #[inline(always)]
    unsafe fn neg_inf_to_zero(x: P8) -> P8 {
        x.map(|v| if v == f32::NEG_INFINITY { 0.0 } else { v })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bit patterns of the narrowing's edges (signed zeros, ties of both formats, the f16
    /// overflow and subnormal ranges, bf16's largest finite, infinities, quiet and signalling
    /// NaN with payloads), then random ones.
    fn patterns() -> Vec<u32> {
        let mut v = vec![
            0x0000_0000,
            0x8000_0000,
            0x3f80_0000,
            0xbf80_0000,
            0x477f_e000,
            0x477f_f000,
            0x477f_efff,
            0x4780_0000,
            0x3380_0000,
            0x3300_0000,
            0x3300_0001,
            0x3280_0000,
            0x3880_0000,
            0x387f_c000,
            0x0d6d_0000,
            0x0000_0001,
            0x3f80_8000,
            0x3f81_8000,
            0x3f80_8001,
            0x3f80_7fff,
            0x7f7f_ffff,
            0xff7f_ffff,
            0x7f80_0000,
            0xff80_0000,
            0x7fc0_0000,
            0xffc0_0000,
            0x7f80_0001,
            0xff80_0001,
            0x7fbf_ffff,
            0x7fc1_2345,
            0x3a00_1000,
            0x3a00_3000,
        ];
        let mut s = 0x9E37_79B9_7F4A_7C15u64;
        for _ in 0..4096 {
            s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            v.push((z ^ (z >> 31)) as u32);
        }
        v.truncate(v.len() / 16 * 16);
        v
    }

    /// `S`'s f16 and bf16 stores give `half`'s bits for every pattern.
    ///
    /// # Safety
    /// `S`'s instruction set is present.
    unsafe fn narrowing_matches_half<S: Simd>(name: &str) {
        let x: Vec<f32> = patterns().into_iter().map(f32::from_bits).collect();
        let (mut h, mut b) = (vec![0u16; x.len()], vec![0u16; x.len()]);
        for i in (0..x.len()).step_by(S::LANES) {
            // SAFETY: `S` is present (the caller's promise); LANES elements at i of each vector.
            unsafe {
                let v = S::load(x.as_ptr().add(i));
                S::store_f16(h.as_mut_ptr().add(i), v);
                S::store_bf16(b.as_mut_ptr().add(i), v);
            }
        }
        for (i, &y) in x.iter().enumerate() {
            assert_eq!(h[i], half::f16::from_f32(y).to_bits(), "{name} f16 of {:#010x}", y.to_bits());
            assert_eq!(b[i], half::bf16::from_f32(y).to_bits(), "{name} bf16 of {:#010x}", y.to_bits());
        }
    }

    #[test]
    fn narrowing_matches_half_on_every_set_present() {
        // SAFETY: the portable set needs nothing beyond the baseline.
        unsafe { narrowing_matches_half::<Portable>("portable") };
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c");
            if avx2 {
                // SAFETY: AVX2 and F16C detected just above.
                unsafe { avx2_case() };
            } else {
                eprintln!("NOT TESTED: avx2 narrowing (this CPU lacks AVX2 or F16C)");
            }
            if avx2 && is_x86_feature_detected!("avx512f") {
                // SAFETY: AVX-512F, AVX2 and F16C detected just above.
                unsafe { avx512_case() };
            } else {
                eprintln!("NOT TESTED: avx512 narrowing (this CPU lacks AVX-512F)");
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn avx2_case() {
        // SAFETY: this function's features are those Avx2 needs.
        unsafe { narrowing_matches_half::<Avx2>("avx2") }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn avx512_case() {
        // SAFETY: this function's features are those Avx512 needs.
        unsafe { narrowing_matches_half::<Avx512>("avx512") }
    }
}
