//! The flash kernel: for a block of queries of one head, stream key/value tiles, keep the running
//! max `m`, the running sum `l` and the unnormalised output in f32, and skip tiles no query of the
//! block can see.

use std::cell::RefCell;

use half::{bf16, f16};
use rayon::prelude::*;

use crate::validate::{key_range, Checked, Seq};

/// Queries per task: small enough that a 2048-query head gives both cores many tasks.
const BQ: usize = 32;
/// Keys per tile.
const BK: usize = 64;

/// An input element the kernel widens to f32 and writes back from f32.
pub(crate) trait Element: Copy + Send + Sync + 'static {
    fn to_f32(self) -> f32;
    fn from_f32(x: f32) -> Self;
}
impl Element for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
}
impl Element for f16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
}
impl Element for bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
}

/// A raw pointer to a slice that tasks write disjoint elements of.
#[derive(Clone, Copy)]
struct SharedOut<T> {
    ptr: *mut T,
    len: usize,
}
// SAFETY: tasks write disjoint indices (one (sequence, head, query) row each) and the owner
// slice outlives the parallel region, which `run` joins before returning.
unsafe impl<T: Send> Send for SharedOut<T> {}
// SAFETY: as above: no two tasks touch the same index.
unsafe impl<T: Send> Sync for SharedOut<T> {}

impl<T> SharedOut<T> {
    fn new(s: &mut [T]) -> Self {
        SharedOut { ptr: s.as_mut_ptr(), len: s.len() }
    }
    /// # Safety
    /// `i < len`, and no other task reads or writes index `i` during the parallel region.
    #[inline(always)]
    unsafe fn write(&self, i: usize, x: T) {
        debug_assert!(i < self.len);
        // SAFETY: the caller guarantees `i` is in bounds and owned by this task.
        unsafe { self.ptr.add(i).write(x) }
    }
}

/// Per-thread tile buffers, grown on first use and reused after.
#[derive(Default)]
struct Scratch {
    q: Vec<f32>,
    o: Vec<f32>,
    kt: Vec<f32>,
    vt: Vec<f32>,
    s: Vec<f32>,
    m: Vec<f32>,
    l: Vec<f32>,
}

impl Scratch {
    fn fit(&mut self, d: usize) {
        fn grow(v: &mut Vec<f32>, n: usize) {
            if v.len() < n {
                v.resize(n, 0.0);
            }
        }
        grow(&mut self.q, BQ * d);
        grow(&mut self.o, BQ * d);
        grow(&mut self.kt, BK * d);
        grow(&mut self.vt, BK * d);
        grow(&mut self.s, BK);
        grow(&mut self.m, BQ);
        grow(&mut self.l, BQ);
    }
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (ac, ar) = a.split_at(a.len() / 8 * 8);
    let (bc, br) = b.split_at(ac.len());
    for (x, y) in ac.chunks_exact(8).zip(bc.chunks_exact(8)) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (x, y) in ar.iter().zip(br) {
        s += x * y;
    }
    s
}

pub(crate) fn run<T: Element>(c: &Checked<'_>, q: &[T], k: &[T], v: &[T], out: &mut [T], lse: Option<&mut [f32]>) {
    let out = SharedOut::new(out);
    let lse = lse.map(SharedOut::new);
    let hq = c.hq;
    (0..c.batch).into_par_iter().for_each(|b| {
        let seq = c.seq(b);
        let nblk = seq.q_len.div_ceil(BQ);
        (0..hq * nblk).into_par_iter().for_each(|t| {
            let (h, blk) = (t / nblk, t % nblk);
            SCRATCH.with(|s| {
                let mut s = s.borrow_mut();
                s.fit(c.d);
                block(c, b, &seq, h, blk * BQ, ((blk + 1) * BQ).min(seq.q_len), q, k, v, out, lse, &mut s);
            });
        });
    });
}

#[allow(clippy::too_many_arguments)]
fn block<T: Element>(
    c: &Checked<'_>,
    b: usize,
    seq: &Seq,
    h: usize,
    i0: usize,
    i1: usize,
    q: &[T],
    k: &[T],
    v: &[T],
    out: SharedOut<T>,
    lse: Option<SharedOut<f32>>,
    sc: &mut Scratch,
) {
    let (d, hq, hkv) = (c.d, c.hq, c.hkv);
    let kh = h / c.group();
    let p = &c.call.params;
    let rows = i1 - i0;
    let Scratch { q: qt, o, kt, vt, s, m, l } = sc;
    let slope = c.call.alibi_slopes.map(|a| a[h]);
    let shift = seq.k_len as i64 - seq.q_len as i64;

    // Keys any query of the block can see: one interval, since each query's is one and both ends
    // move monotonically with the query index.
    let mut lo_all = usize::MAX;
    let mut hi_all = 0;
    for r in 0..rows {
        let i = i0 + r;
        let qrow = &q[((seq.q_start + i) * hq + h) * d..][..d];
        for (x, &y) in qt[r * d..(r + 1) * d].iter_mut().zip(qrow) {
            *x = y.to_f32();
        }
        o[r * d..(r + 1) * d].fill(0.0);
        m[r] = f32::NEG_INFINITY;
        l[r] = 0.0;
        let (lo, hi) = key_range(i, seq.q_len, seq.k_len, p);
        if lo < hi {
            lo_all = lo_all.min(lo);
            hi_all = hi_all.max(hi);
        }
    }

    let mut j0 = lo_all;
    while j0 < hi_all {
        let j1 = (j0 + BK).min(hi_all);
        let n = j1 - j0;
        for jj in 0..n {
            let row = (c.k_row(b, seq, j0 + jj) * hkv + kh) * d;
            for (x, &y) in kt[jj * d..(jj + 1) * d].iter_mut().zip(&k[row..row + d]) {
                *x = y.to_f32();
            }
            for (x, &y) in vt[jj * d..(jj + 1) * d].iter_mut().zip(&v[row..row + d]) {
                *x = y.to_f32();
            }
        }
        for r in 0..rows {
            let i = i0 + r;
            let (lo, hi) = key_range(i, seq.q_len, seq.k_len, p);
            let (a, e) = (lo.max(j0), hi.min(j1));
            if a >= e {
                continue; // this tile is fully masked for this query
            }
            let qr = &qt[r * d..(r + 1) * d];
            let ia = i as i64 + shift;
            let mut tile_max = f32::NEG_INFINITY;
            for j in a..e {
                let jj = j - j0;
                let mut x = c.scale * dot(qr, &kt[jj * d..(jj + 1) * d]);
                if let Some(cap) = p.softcap {
                    x = cap * (x / cap).tanh();
                }
                if let Some(sl) = slope {
                    x -= sl * (ia - j as i64).unsigned_abs() as f32;
                }
                s[jj] = x;
                tile_max = tile_max.max(x);
            }
            let m_new = m[r].max(tile_max);
            if m_new == f32::NEG_INFINITY {
                continue;
            }
            let alpha = (m[r] - m_new).exp();
            let orow = &mut o[r * d..(r + 1) * d];
            if alpha != 1.0 {
                for x in orow.iter_mut() {
                    *x *= alpha;
                }
            }
            let mut sum = 0.0;
            for j in a..e {
                let jj = j - j0;
                let pj = (s[jj] - m_new).exp();
                sum += pj;
                // A zero weight must not multiply a value it cannot see (0 * NaN is NaN).
                if pj != 0.0 {
                    for (x, &y) in orow.iter_mut().zip(&vt[jj * d..(jj + 1) * d]) {
                        *x += pj * y;
                    }
                }
            }
            l[r] = l[r] * alpha + sum;
            m[r] = m_new;
        }
        j0 = j1;
    }

    for r in 0..rows {
        let i = i0 + r;
        let base = ((seq.q_start + i) * hq + h) * d;
        let (inv, lse_v) = if l[r] > 0.0 { (1.0 / l[r], m[r] + l[r].ln()) } else { (0.0, f32::NEG_INFINITY) };
        for x in 0..d {
            let y = if l[r] > 0.0 { o[r * d + x] * inv } else { 0.0 };
            // SAFETY: row (seq, i, h) belongs to this task alone and `base + x` is inside out.
            unsafe { out.write(base + x, T::from_f32(y)) };
        }
        if let Some(ls) = lse {
            // SAFETY: lse index (seq, h, i) belongs to this task alone and is inside lse.
            unsafe { ls.write(c.lse_index(b, seq, h, i), lse_v) };
        }
    }
}
