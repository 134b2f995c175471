//! The machine's f32 FMA peak, measured with register-resident FMA chains on every rayon thread,
//! so benches can report the fraction of it a kernel reaches.

use std::time::Instant;

use rayon::prelude::*;

/// Independent accumulator chains: enough to cover FMA latency x issue width.
const CHAINS: usize = 12;

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn fma_avx512(iters: u64) -> f32 {
    use std::arch::x86_64::*;
    let a = _mm512_set1_ps(0.999_999);
    let b = _mm512_set1_ps(1e-7);
    let mut acc = [_mm512_set1_ps(1.0); CHAINS];
    for _ in 0..iters {
        for x in acc.iter_mut() {
            *x = _mm512_fmadd_ps(*x, a, b);
        }
    }
    let mut s = _mm512_setzero_ps();
    for x in acc {
        s = _mm512_add_ps(s, x);
    }
    _mm512_reduce_add_ps(s)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn fma_avx2(iters: u64) -> f32 {
    use std::arch::x86_64::*;
    let a = _mm256_set1_ps(0.999_999);
    let b = _mm256_set1_ps(1e-7);
    let mut acc = [_mm256_set1_ps(1.0); CHAINS];
    for _ in 0..iters {
        for x in acc.iter_mut() {
            *x = _mm256_fmadd_ps(*x, a, b);
        }
    }
    let mut out = [0.0f32; 8];
    let mut s = _mm256_setzero_ps();
    for x in acc {
        s = _mm256_add_ps(s, x);
    }
    _mm256_storeu_ps(out.as_mut_ptr(), s);
    out.iter().sum()
}

fn fma_portable(iters: u64) -> f32 {
    let mut acc = [[1.0f32; 8]; CHAINS];
    for _ in 0..iters {
        for x in acc.iter_mut() {
            for l in x.iter_mut() {
                *l = l.mul_add(0.999_999, 1e-7);
            }
        }
        std::hint::black_box(&mut acc);
    }
    acc.iter().flatten().sum()
}

/// Lanes per FMA of the widest unit found at run time, and a function that runs `iters` rounds of
/// `CHAINS` FMAs of that width.
fn widest() -> (usize, &'static str, fn(u64) -> f32) {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx512f") {
            // SAFETY: avx512f was detected at run time just above.
            return (16, "avx512", |n| unsafe { fma_avx512(n) });
        }
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            // SAFETY: avx2 and fma were detected at run time just above.
            return (8, "avx2+fma", |n| unsafe { fma_avx2(n) });
        }
    }
    (8, "portable", fma_portable)
}

/// The measured f32 FMA peak in GFLOP/s over every rayon thread (2 FLOP per lane per FMA), and
/// the instruction set it used. Takes about a quarter of a second.
pub fn fma_peak_gflops() -> (f64, &'static str) {
    let (lanes, isa, f) = widest();
    let threads = rayon::current_num_threads();
    let iters = 20_000_000u64 / lanes as u64;
    let _ = std::hint::black_box(f(iters / 10)); // warm up clocks
    let mut best = 0.0f64;
    for _ in 0..3 {
        let t = Instant::now();
        let s: f32 = (0..threads).into_par_iter().map(|_| f(iters)).sum();
        std::hint::black_box(s);
        let secs = t.elapsed().as_secs_f64();
        let flops = 2.0 * (lanes * CHAINS) as f64 * iters as f64 * threads as f64;
        best = best.max(flops / secs / 1e9);
    }
    (best, isa)
}
