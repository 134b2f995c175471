//! The flash kernel. A task owns a block of query rows (query positions x the query heads of one
//! GQA group, position-major so each row's visible key interval moves monotonically) and a range
//! of keys. It streams key/value tiles of [`BK`] keys, packs each tile once as f32 (widening
//! f16/bf16 in registers) for all its rows, and keeps the running max `m`, sum `l` and
//! unnormalised output `o` in f32.
//!
//! Layout of the work, chosen so no transpose is ever needed on the hot path:
//! - `qt` is the task's queries transposed once, `[D][Rp]`, pre-multiplied by `scale * log2(e)`;
//! - `s = k·qᵀ` is computed key-major, `[BK][Rp]`: a register tile of `MR` keys (broadcast) by two
//!   vectors of rows, so the softmax runs down the key axis with rows in the lanes, and `m`, `l`
//!   are per-lane vectors (no horizontal reductions);
//! - `o += p·v` is a register tile of `MR` rows (broadcast from `s`) by two vectors of `D`.
//!
//! Tiles no row can see are never visited; tiles every row sees in full run with no per-element
//! mask work; only tiles on a mask edge apply a per-element mask. A key a row cannot see is never
//! multiplied into that row (so NaN in a value another row can see cannot leak), which is why
//! `p·v` runs the shared register tile over the keys all its rows see and the rest row by row.
//!
//! Decode (few tasks, many keys) splits the keys of each task over several tasks (flash-decoding)
//! and merges their partial `(m, l, o)` with the log-sum-exp; the partials live in a buffer the
//! backend keeps and grows once.

use std::sync::{Mutex, OnceLock};

use half::{bf16, f16};
use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
use super::simd::{Avx2, Avx512};
use super::simd::{Portable, Simd};
use crate::validate::{key_range, Checked, Seq};

/// Keys per tile. 64 keys x D 128 x 4 B = 32 KiB per packed k or v tile: with the task's q, s and
/// o (128 rows) the working set stays in L2, and the register tiles stream from L1.
const BK: usize = 64;
/// Query rows per task (query positions x heads of a group) of a call without a causal or window
/// mask: at S = 2048, H = 16 that is 128 tasks, plenty for two cores. Every task of a head streams
/// that head's whole K and V (2 MiB in f32 at S 2048, D 128: more than a core's L2), so the rows
/// per task set how often they come from memory: on a 2-core Xeon (Emerald Rapids) 128 rows
/// timed 4-10% faster than 64, and 256 another 5-7% at D 128 (2-3% at D 64), f32. Masked calls
/// (causal, window) take the same: their tasks had 128 rows while the q and s tiles' row stride
/// was a power of two (which cost 256-row tasks more); with [`row_stride`], 256 rows timed their
/// causal calls 2-13% faster on a 2-core Xeon (model 167), causal / full 0.544-0.557.
const ROWS: usize = 256;
/// Largest lane count of any instruction set, for padding.
const MAX_LANES: usize = 16;
/// Most vectors of rows a task has: [`ROWS`] rows at the fewest lanes of any set (8).
const MAX_VECS: usize = ROWS / 8;

/// Row stride (elements) of a tile whose rows hold `rp` padded elements: an odd number of 64-byte
/// lines once a row is 256 bytes or more. The q·k kernel walks the transposed q tile down D and
/// p·v walks s down the keys, one row per step; a stride of 512 or 1024 bytes maps those rows to
/// 8 or 4 of the L1's 64 sets, fewer lines than one kernel call touches, so they evicted each
/// other. (The packed k and v tiles, 512-byte rows at D 128 f32, timed no faster off it.)
const fn row_stride(rp: usize) -> usize {
    if rp >= 4 * MAX_LANES && (rp / MAX_LANES).is_multiple_of(2) {
        rp + MAX_LANES
    } else {
        rp
    }
}

/// At most this many rows per kv head (decode: one position times a GQA group of up to 4), q·kᵀ
/// runs as dot products along D straight from the cache rows ([`dot_rows`]) instead of the
/// rows-in-lanes tile, which would leave most lanes empty; k is then never packed.
const DIRECT_ROWS: usize = 4;
/// Q rows are asked for this many rows ahead of their packing: a task's rows are strided in
/// memory (one head of a token each), and packing them one miss at a time took 3-4% of a prefill
/// call by `perf annotate` on a 2-core Xeon (model 167), a cost per row that a causal call, with
/// half the work, pays in full. Measured there: causal at D 64 4-6% faster, full-mask and D 128
/// unchanged (docs/PERF_NOTES.md, cpu v9).
const Q_AHEAD: usize = 8;

/// An input element: widened to f32 when packed, narrowed when the output row is written.
pub(crate) trait Element: Copy + Send + Sync + 'static {
    fn to_f32(self) -> f32;
    /// `S::LANES` elements at `p`, widened.
    ///
    /// # Safety
    /// `S`'s instruction set is present and `S::LANES` elements are readable at `p`.
    unsafe fn load<S: Simd>(p: *const Self) -> S::V;
    /// Zero: the output of a row that sees no key.
    const ZERO: Self;
    /// `LANES` values narrowed (rounding to nearest even) and stored at `p`.
    ///
    /// # Safety
    /// `S`'s instruction set is present and `S::LANES` elements are writable at `p`.
    unsafe fn store<S: Simd>(p: *mut Self, v: S::V);
    /// One element narrowed, rounding to nearest even (as `store`).
    fn narrow(x: f32) -> Self;
}
impl Element for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    unsafe fn load<S: Simd>(p: *const f32) -> S::V {
        // SAFETY: forwarded from the caller.
        unsafe { S::load(p) }
    }
    const ZERO: f32 = 0.0;
    #[inline(always)]
    unsafe fn store<S: Simd>(p: *mut f32, v: S::V) {
        // SAFETY: forwarded from the caller.
        unsafe { S::store(p, v) }
    }
    #[inline(always)]
    fn narrow(x: f32) -> f32 {
        x
    }
}
/// The two 16-bit formats: bit patterns that `S` widens and narrows with its own instructions.
macro_rules! half_element {
    ($t:ident, $load:ident, $store:ident) => {
        impl Element for $t {
            #[inline(always)]
            fn to_f32(self) -> f32 {
                $t::to_f32(self)
            }
            #[inline(always)]
            unsafe fn load<S: Simd>(p: *const $t) -> S::V {
                // SAFETY: forwarded from the caller; the format is a u16 bit pattern.
                unsafe { S::$load(p as *const u16) }
            }
            const ZERO: $t = $t::ZERO;
            #[inline(always)]
            unsafe fn store<S: Simd>(p: *mut $t, v: S::V) {
                // SAFETY: forwarded from the caller; the format is a u16 bit pattern.
                unsafe { S::$store(p as *mut u16, v) }
            }
            #[inline(always)]
            fn narrow(x: f32) -> $t {
                $t::from_f32(x)
            }
        }
    };
}
half_element!(f16, load_f16, store_f16);
half_element!(bf16, load_bf16, store_bf16);

/// A raw pointer to a slice that tasks write disjoint elements of.
#[derive(Clone, Copy)]
struct SharedOut<T> {
    ptr: *mut T,
    len: usize,
}
// SAFETY: tasks write disjoint ranges (one (sequence, head, query) row, or one partial slot, each)
// and the owner slice outlives the parallel region, which `run` joins before returning.
unsafe impl<T: Send> Send for SharedOut<T> {}
// SAFETY: as above: no two tasks touch the same index.
unsafe impl<T: Send> Sync for SharedOut<T> {}

impl<T> SharedOut<T> {
    fn new(s: &mut [T]) -> Self {
        SharedOut { ptr: s.as_mut_ptr(), len: s.len() }
    }
    /// # Safety
    /// No other task reads or writes `start..start + n` during the parallel region.
    #[inline(always)]
    #[allow(clippy::mut_from_ref)]
    unsafe fn slice(&self, start: usize, n: usize) -> &mut [T] {
        assert!(start + n <= self.len);
        // SAFETY: in bounds (checked above) and owned by this task (the caller's promise).
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(start), n) }
    }
}

/// The instruction set the kernel runs with, detected once. `ATTNKIT_CPU_ISA=avx2|portable`
/// forces a lower one (to test those paths on a machine that has more).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Isa {
    #[cfg(target_arch = "x86_64")]
    Avx512,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    Portable,
}

pub(crate) fn isa() -> Isa {
    static ISA: OnceLock<Isa> = OnceLock::new();
    *ISA.get_or_init(|| {
        let want = std::env::var("ATTNKIT_CPU_ISA").unwrap_or_default();
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 =
                is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c");
            if is_x86_feature_detected!("avx512f") && avx2 && want != "avx2" && want != "portable" {
                return Isa::Avx512;
            }
            if avx2 && want != "portable" {
                return Isa::Avx2;
            }
        }
        let _ = want;
        Isa::Portable
    })
}

/// A buffer of f32 whose working slice starts on a 64-byte boundary.
#[derive(Default)]
struct Buf(Vec<f32>);
impl Buf {
    /// Grow (once) to hold `n` elements however the slice is aligned.
    fn reserve(&mut self, n: usize) {
        if self.0.len() < n + MAX_LANES {
            self.0.resize(n + MAX_LANES, 0.0);
        }
    }
    fn get(&mut self, n: usize) -> &mut [f32] {
        self.reserve(n);
        let off = self.0.as_ptr().align_offset(64).min(MAX_LANES);
        &mut self.0[off..off + n]
    }
}

/// Per-thread tile buffers, grown on first use and reused after.
#[derive(Default)]
struct Scratch {
    qt: Buf,
    /// q rows, scaled, one after another (`DIRECT_ROWS` per kv head): the decode path.
    qr: Buf,
    s: Buf,
    kp: Buf,
    vp: Buf,
    o: Buf,
    row: Buf,
    m: Buf,
    l: Buf,
    alpha: Buf,
    /// Per row: in-tile visible keys [a, e) as f32 (for vector compares).
    af: Buf,
    ef: Buf,
    /// Per row: ALiBi slope and aligned query index (slow path only).
    slope: Buf,
    ia: Buf,
    lo: Vec<usize>,
    hi: Vec<usize>,
    a: Vec<usize>,
    e: Vec<usize>,
}

impl Scratch {
    /// Grow every buffer to what the largest task of `plan` needs. Which tasks a thread gets
    /// varies from call to call (ragged varlen blocks are smaller; a thread may get none), so
    /// sizing per task would allocate whenever a thread first met a larger one, long after
    /// warm-up.
    fn reserve_for(&mut self, c: &Checked<'_>, plan: &Plan) {
        let rp = (plan.bq * plan.hn).next_multiple_of(MAX_LANES);
        let ra = plan.nh * rp;
        // A task's rows padded to its own lanes stride at most one more vector than `rp`.
        let rs = rp + MAX_LANES;
        let dp = plan.dp;
        for (b, n) in [
            (&mut self.qt, c.d * plan.nh * rs),
            (&mut self.qr, plan.nh * DIRECT_ROWS * dp),
            (&mut self.s, BK * rs),
            (&mut self.kp, BK * dp),
            (&mut self.vp, BK * dp),
            (&mut self.o, ra * dp),
            (&mut self.row, dp),
            (&mut self.m, ra),
            (&mut self.l, ra),
            (&mut self.alpha, ra),
            (&mut self.slope, ra),
            (&mut self.af, rp),
            (&mut self.ef, rp),
            (&mut self.ia, rp),
        ] {
            b.reserve(n);
        }
        for x in [&mut self.lo, &mut self.hi, &mut self.a, &mut self.e] {
            x.reserve(rp.saturating_sub(x.len()));
        }
    }
}

/// One scratch per thread of the pool that runs the tasks (rayon's thread index), and a last one
/// for a caller outside any pool. `run` sizes them all for its plan before a task starts, so
/// allocation happens only in the first call of a larger plan, on the thread that runs `run`.
fn scratches() -> &'static [Mutex<Scratch>] {
    static SCRATCHES: OnceLock<Vec<Mutex<Scratch>>> = OnceLock::new();
    SCRATCHES.get_or_init(|| (0..=rayon::current_num_threads()).map(|_| Mutex::new(Scratch::default())).collect())
}

/// The calling thread's scratch.
fn with_scratch<R>(f: impl FnOnce(&mut Scratch) -> R) -> R {
    let all = scratches();
    let i = rayon::current_thread_index().unwrap_or(all.len() - 1).min(all.len() - 1);
    // A thread only ever locks its own slot (a foreign pool larger than ours shares the last
    // one, which serialises it but stays correct).
    let mut s = all[i].lock().unwrap_or_else(|e| e.into_inner());
    f(&mut s)
}

/// How the work is cut: `bq` query positions x `hn` heads per task, `hparts` tasks per group,
/// and each task's keys split in `nsplit`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Plan {
    bq: usize,
    hn: usize,
    hparts: usize,
    /// kv heads per task.
    nh: usize,
    nsplit: usize,
    dp: usize,
    /// Rows of a partial slot (rows of a task, all its kv heads), rounded up to the lane count.
    rp: usize,
}

impl Plan {
    pub(crate) fn new(c: &Checked<'_>) -> Plan {
        let g = c.group();
        let hn = g.min(ROWS);
        let hparts = g.div_ceil(hn);
        let bq = (ROWS / hn).max(1).min(c.max_q.max(1));
        // Few rows per kv head (decode): a task takes several kv heads, so it reads whole token
        // rows (every head of a token is adjacent) instead of a short strided run per head.
        let nh = (ROWS / (bq * hn)).clamp(1, c.hkv);
        let groups: usize =
            (0..c.batch).map(|b| c.seq(b).q_len.div_ceil(bq)).sum::<usize>() * c.hkv.div_ceil(nh) * hparts;
        // Fewer tasks than a few per thread: split the keys (flash-decoding), at least two tiles each.
        let want = 4 * rayon::current_num_threads();
        let nsplit = if groups > 0 && groups < want { want.div_ceil(groups).min(c.max_k / (2 * BK)).max(1) } else { 1 };
        let dp = c.d.next_multiple_of(MAX_LANES);
        let rp = (nh * bq * hn).next_multiple_of(MAX_LANES);
        Plan { bq, hn, hparts, nh, nsplit, dp, rp }
    }
    /// f32 elements of one partial slot: m and l per row, then o.
    fn slot(&self) -> usize {
        self.rp * (2 + self.dp)
    }
    /// Partial f32 elements the whole call needs (0 without a split).
    pub(crate) fn partial_len(&self, c: &Checked<'_>) -> usize {
        if self.nsplit == 1 {
            return 0;
        }
        self.groups_before(c, c.batch) * self.nsplit * self.slot()
    }
    fn groups_of(&self, c: &Checked<'_>, seq: &Seq) -> usize {
        c.hkv.div_ceil(self.nh) * self.hparts * seq.q_len.div_ceil(self.bq)
    }
    fn groups_before(&self, c: &Checked<'_>, b: usize) -> usize {
        (0..b).map(|x| self.groups_of(c, &c.seq(x))).sum()
    }
}

/// Everything a task reads, and where it writes.
struct Ctx<'a, T> {
    c: &'a Checked<'a>,
    plan: Plan,
    q: &'a [T],
    k: &'a [T],
    v: &'a [T],
    out: SharedOut<T>,
    lse: Option<SharedOut<f32>>,
    partial: SharedOut<f32>,
}

/// One task: group `grp` of sequence `b` (kv head, head part, query block), key split `split`,
/// partial slot `slot` (used when the plan splits keys).
#[derive(Clone, Copy)]
struct Task {
    b: usize,
    seq: Seq,
    grp: usize,
    split: usize,
    slot: usize,
}

pub(crate) fn run<T: Element>(
    c: &Checked<'_>,
    q: &[T],
    k: &[T],
    v: &[T],
    out: &mut [T],
    lse: Option<&mut [f32]>,
    partial: &mut Vec<f32>,
) {
    let plan = Plan::new(c);
    let need = plan.partial_len(c);
    if partial.len() < need {
        partial.resize(need, 0.0);
    }
    let ctx = Ctx {
        c,
        plan,
        q,
        k,
        v,
        out: SharedOut::new(out),
        lse: lse.map(SharedOut::new),
        partial: SharedOut::new(partial),
    };
    let isa = isa();
    let ns = plan.nsplit;
    for sc in scratches() {
        sc.lock().unwrap_or_else(|e| e.into_inner()).reserve_for(c, &plan);
    }
    (0..c.batch).into_par_iter().for_each(|b| {
        let seq = c.seq(b);
        let groups = plan.groups_of(c, &seq);
        let base = if ns > 1 { plan.groups_before(c, b) } else { 0 };
        (0..groups * ns).into_par_iter().for_each(|t| {
            let task = Task { b, seq, grp: t / ns, split: t % ns, slot: (base + t / ns) * ns + t % ns };
            with_scratch(|s| dispatch(isa, &ctx, task, s));
        });
    });
    if ns > 1 {
        (0..c.batch).into_par_iter().for_each(|b| {
            let seq = c.seq(b);
            let base = plan.groups_before(c, b);
            (0..plan.groups_of(c, &seq)).into_par_iter().for_each(|grp| {
                with_scratch(|s| merge(&ctx, b, &seq, grp, base + grp, s));
            });
        });
    }
}

fn dispatch<T: Element>(isa: Isa, ctx: &Ctx<'_, T>, t: Task, s: &mut Scratch) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => {
            // SAFETY: `isa()` returned Avx512 only after detecting AVX-512F, AVX2, FMA and F16C.
            unsafe { task_avx512(ctx, t, s) }
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => {
            // SAFETY: `isa()` returned Avx2 only after detecting AVX2, FMA and F16C.
            unsafe { task_avx2(ctx, t, s) }
        }
        Isa::Portable => {
            // SAFETY: the portable set needs nothing beyond the target's baseline.
            unsafe { task::<Portable, T>(ctx, t, s) }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn task_avx512<T: Element>(ctx: &Ctx<'_, T>, t: Task, s: &mut Scratch) {
    // SAFETY: this function's features are those Avx512 needs.
    unsafe { task::<Avx512, T>(ctx, t, s) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn task_avx2<T: Element>(ctx: &Ctx<'_, T>, t: Task, s: &mut Scratch) {
    // SAFETY: this function's features are those Avx2 needs.
    unsafe { task::<Avx2, T>(ctx, t, s) }
}

/// Widen `d` elements of `src` into `dst`, zero-padding past `d`.
///
/// # Safety
/// `S`'s instruction set is present.
#[inline(always)]
unsafe fn pack_row<S: Simd, T: Element>(src: &[T], d: usize, dst: &mut [f32]) {
    let dp = dst.len();
    assert!(src.len() >= d && dp >= d);
    let mut x = 0;
    while x + S::LANES <= d {
        // SAFETY: x + LANES <= d <= both lengths.
        unsafe { S::store(dst.as_mut_ptr().add(x), T::load::<S>(src.as_ptr().add(x))) };
        x += S::LANES;
    }
    for i in x..d {
        dst[i] = src[i].to_f32();
    }
    dst[d..dp].fill(0.0);
}

/// `s[j][r0..r0 + NR*L] = k[j]·qt[..][r0..]` for `MK` keys from `j0`.
///
/// # Safety
/// `S` is present; `qt` holds `d` rows of `rp` and `r0 + NR*L <= rp`; `kp` holds `j0 + MK` rows of
/// `dp >= d`; `s` holds `j0 + MK` rows of `rp`.
#[inline(always)]
unsafe fn qk<S: Simd, const MK: usize, const NR: usize>(
    qt: *const f32,
    kp: *const f32,
    s: *mut f32,
    (rp, dp, d): (usize, usize, usize),
    r0: usize,
    j0: usize,
) {
    // SAFETY: every offset is inside the extents the caller guarantees (whole body).
    unsafe {
        let mut acc = [[S::zero(); NR]; MK];
        for x in 0..d {
            let mut qv = [S::zero(); NR];
            for (n, v) in qv.iter_mut().enumerate() {
                *v = S::load(qt.add(x * rp + r0 + n * S::LANES));
            }
            for (m, a) in acc.iter_mut().enumerate() {
                let kb = S::splat(*kp.add((j0 + m) * dp + x));
                for n in 0..NR {
                    a[n] = S::fma(kb, qv[n], a[n]);
                }
            }
        }
        for (m, a) in acc.iter().enumerate() {
            for (n, v) in a.iter().enumerate() {
                S::store(s.add((j0 + m) * rp + r0 + n * S::LANES), *v);
            }
        }
    }
}

/// Ask for the lines of one row (a q row a few rows ahead of its packing).
#[inline(always)]
fn prefetch_row<S: Simd, T: Element>(row: &[T]) {
    let p = row.as_ptr() as *const u8;
    for y in (0..std::mem::size_of_val(row)).step_by(64) {
        // SAFETY: a prefetch never faults; the addresses stay inside the row.
        unsafe { S::prefetch(p.add(y)) };
    }
}

/// Ask for the k and v rows of `d` elements at element `at` (into L2, see [`Simd::prefetch`]).
#[inline(always)]
fn prefetch_kv<S: Simd, T: Element>(ctx: &Ctx<'_, T>, at: usize) {
    let d = ctx.c.d;
    let (pk, pv) = (ctx.k[at..at + d].as_ptr() as *const u8, ctx.v[at..at + d].as_ptr() as *const u8);
    for y in (0..d * std::mem::size_of::<T>()).step_by(64) {
        // SAFETY: a prefetch never faults; the addresses stay inside the rows.
        unsafe {
            S::prefetch(pk.add(y));
            S::prefetch(pv.add(y));
        }
    }
}

/// `s[r] = q[r]·k` for the `R` rows of `q` (rows `dp` apart, scaled), lanes `R..LANES` of `s` zero.
///
/// # Safety
/// `S` is present; `q` holds `R` rows of `dp >= d`; `k` holds `d` elements; `s` holds `S::LANES`.
#[inline(always)]
unsafe fn dot_rows<S: Simd, T: Element, const R: usize>(q: *const f32, dp: usize, k: *const T, d: usize, s: *mut f32) {
    let l = S::LANES;
    // SAFETY: every offset is below `d` for k and below `R * dp` for q; `s` as promised.
    unsafe {
        // Two accumulators per row: the FMA chains are half as long.
        let mut acc = [[S::zero(); 2]; R];
        let mut x = 0;
        while x + 2 * l <= d {
            let (k0, k1) = (T::load::<S>(k.add(x)), T::load::<S>(k.add(x + l)));
            for (r, a) in acc.iter_mut().enumerate() {
                a[0] = S::fma(k0, S::load(q.add(r * dp + x)), a[0]);
                a[1] = S::fma(k1, S::load(q.add(r * dp + x + l)), a[1]);
            }
            x += 2 * l;
        }
        if x + l <= d {
            let k0 = T::load::<S>(k.add(x));
            for (r, a) in acc.iter_mut().enumerate() {
                a[0] = S::fma(k0, S::load(q.add(r * dp + x)), a[0]);
            }
            x += l;
        }
        let mut out = [0.0f32; MAX_LANES];
        for (r, a) in acc.iter().enumerate() {
            let mut v = S::reduce_add(S::add(a[0], a[1]));
            for y in x..d {
                v += (*k.add(y)).to_f32() * *q.add(r * dp + y);
            }
            out[r] = v;
        }
        S::store(s, S::load(out.as_ptr()));
    }
}

/// `o[r0..r0 + MR][d0..d0 + NR*L] += sum over j in ja..jb of p[j][r] * v[j][..]`.
///
/// # Safety
/// `S` is present; `p` holds `jb` rows of `rp`, `r0 + MR <= rp`; `vp` holds `jb` rows of `dp`,
/// `d0 + NR*L <= dp`; `o` holds `r0 + MR` rows of `dp`.
#[inline(always)]
unsafe fn pv<S: Simd, const MR: usize, const NR: usize>(
    p: *const f32,
    vp: *const f32,
    o: *mut f32,
    (rp, dp): (usize, usize),
    r0: usize,
    d0: usize,
    (ja, jb): (usize, usize),
) {
    // SAFETY: every offset is inside the extents the caller guarantees (whole body).
    unsafe {
        let mut acc = [[S::zero(); NR]; MR];
        for (m, a) in acc.iter_mut().enumerate() {
            for (n, v) in a.iter_mut().enumerate() {
                *v = S::load(o.add((r0 + m) * dp + d0 + n * S::LANES));
            }
        }
        for j in ja..jb {
            let mut vv = [S::zero(); NR];
            for (n, v) in vv.iter_mut().enumerate() {
                *v = S::load(vp.add(j * dp + d0 + n * S::LANES));
            }
            for (m, a) in acc.iter_mut().enumerate() {
                let pb = S::splat(*p.add(j * rp + r0 + m));
                for n in 0..NR {
                    a[n] = S::fma(pb, vv[n], a[n]);
                }
            }
        }
        for (m, a) in acc.iter().enumerate() {
            for (n, v) in a.iter().enumerate() {
                S::store(o.add((r0 + m) * dp + d0 + n * S::LANES), *v);
            }
        }
    }
}

/// `pv` over every vector of `D`, for `MR` rows.
///
/// # Safety
/// As [`pv`], with `dp` a multiple of `S::LANES`.
#[inline(always)]
unsafe fn pv_rows<S: Simd, const MR: usize>(
    p: *const f32,
    vp: *const f32,
    o: *mut f32,
    dims: (usize, usize),
    r0: usize,
    keys: (usize, usize),
) {
    let nv = dims.1 / S::LANES;
    let mut x = 0;
    // SAFETY: d0 + NR * LANES <= dp in each call; the rest is the caller's promise.
    unsafe {
        while x + 2 <= nv {
            pv::<S, MR, 2>(p, vp, o, dims, r0, x * S::LANES, keys);
            x += 2;
        }
        if x < nv {
            pv::<S, MR, 1>(p, vp, o, dims, r0, x * S::LANES, keys);
        }
    }
}

/// Where a group's rows are: kv heads `kh0..kh0 + nkh`, query heads `hs..hs + hn` of each of their
/// groups (offsets within the group), query positions `i0..i0 + ni`.
struct Rows {
    kh0: usize,
    nkh: usize,
    hs: usize,
    hn: usize,
    i0: usize,
    ni: usize,
}

impl Rows {
    fn of(c: &Checked<'_>, plan: &Plan, seq: &Seq, grp: usize) -> Rows {
        let nq = seq.q_len.div_ceil(plan.bq);
        let per_kv = plan.hparts * nq;
        let (khp, rest) = (grp / per_kv, grp % per_kv);
        let (hp, qb) = (rest / nq, rest % nq);
        let kh0 = khp * plan.nh;
        let i0 = qb * plan.bq;
        Rows {
            kh0,
            nkh: plan.nh.min(c.hkv - kh0),
            hs: hp * plan.hn,
            hn: plan.hn.min(c.group() - hp * plan.hn),
            i0,
            ni: plan.bq.min(seq.q_len - i0),
        }
    }
    /// Rows per kv head.
    fn per_head(&self) -> usize {
        self.ni * self.hn
    }
    /// (query position, query head) of row `r` of kv head `kh0 + x`.
    fn at(&self, c: &Checked<'_>, x: usize, r: usize) -> (usize, usize) {
        (self.i0 + r / self.hn, (self.kh0 + x) * c.group() + self.hs + r % self.hn)
    }
}

/// One task.
///
/// # Safety
/// `S`'s instruction set is present.
#[inline(always)]
unsafe fn task<S: Simd, T: Element>(ctx: &Ctx<'_, T>, t: Task, sc: &mut Scratch) {
    let c = ctx.c;
    let plan = ctx.plan;
    let p = &c.call.params;
    let (d, dp, hq, hkv) = (c.d, plan.dp, c.hq, c.hkv);
    let seq = &t.seq;
    let rw = Rows::of(c, &plan, seq, t.grp);
    let rows = rw.per_head();
    // Rows of one kv head, padded to the lanes; kv head x owns rows x * rp.. of the per-row state.
    let rp = rows.next_multiple_of(S::LANES);
    let ra = rw.nkh * rp;
    // Row stride of qt and s.
    let rs = row_stride(rp);
    let slow = p.softcap.is_some() || c.call.alibi_slopes.is_some();
    let log2e = std::f32::consts::LOG2_E;
    // Fast path: q carries scale * log2(e), so s is already in log2 units.
    let qscale = if slow { 1.0 } else { c.scale * log2e };

    let Scratch { qt, qr, s, kp, vp, o, row, m, l, alpha, af, ef, slope, ia, lo, hi, a, e } = sc;
    let qt = qt.get(d * rw.nkh * rs);
    let direct = rows <= DIRECT_ROWS;
    let qr = qr.get(if direct { rw.nkh * DIRECT_ROWS * dp } else { 0 });
    let s = s.get(BK * rs);
    let kp = kp.get(BK * dp);
    let vp = vp.get(BK * dp);
    let o = o.get(ra * dp);
    let row = row.get(dp);
    let m = m.get(ra);
    let l = l.get(ra);
    let alpha = alpha.get(ra);
    let slope = slope.get(ra);
    let af = af.get(rp);
    let ef = ef.get(rp);
    let ia = ia.get(rp);
    for x in [&mut *lo, &mut *hi, &mut *a, &mut *e] {
        x.clear();
        x.resize(rp, 0);
    }

    // Rows: r = position * hn + head, so each row's key interval moves monotonically with r; the
    // interval depends on the position alone, so every kv head shares lo/hi (and a/e per tile).
    let shift = seq.k_len as i64 - seq.q_len as i64;
    let (mut lo_all, mut hi_all) = (usize::MAX, 0);
    for r in 0..rp {
        let (i, _) = rw.at(c, 0, r.min(rows - 1)); // padding rows copy the last real row
        let (x, y) = key_range(i, seq.q_len, seq.k_len, p);
        (lo[r], hi[r]) = (x, y);
        if x < y {
            lo_all = lo_all.min(x);
            hi_all = hi_all.max(y);
        }
        ia[r] = (i as i64 + shift) as f32;
    }
    // The q row of (query position, query head).
    let q_row = |(i, h): (usize, usize)| &ctx.q[((seq.q_start + i) * hq + h) * d..][..d];
    for x in 0..rw.nkh {
        let qt = &mut qt[x * d * rs..(x + 1) * d * rs];
        for r in 0..Q_AHEAD.min(rows) {
            prefetch_row::<S, T>(q_row(rw.at(c, x, r)));
        }
        for r in 0..rp {
            let (i, h) = rw.at(c, x, r.min(rows - 1));
            slope[x * rp + r] = c.call.alibi_slopes.map_or(0.0, |a| a[h]);
            if r + Q_AHEAD < rows {
                prefetch_row::<S, T>(q_row(rw.at(c, x, r + Q_AHEAD)));
            }
            if r < rows {
                let src = q_row((i, h));
                // SAFETY: `S` is present (the caller's promise).
                unsafe { pack_row::<S, T>(src, d, row) };
                if direct {
                    // The direct path reads q by rows; the transposed tile is never used.
                    let qd = &mut qr[(x * DIRECT_ROWS + r) * dp..][..d];
                    qd.iter_mut().zip(&row[..d]).for_each(|(w, &z)| *w = z * qscale);
                } else {
                    for (y, &z) in row[..d].iter().enumerate() {
                        qt[y * rs + r] = z * qscale;
                    }
                }
            } else if !direct {
                for y in 0..d {
                    qt[y * rs + r] = 0.0;
                }
            }
        }
    }
    o.fill(0.0);
    m.fill(f32::NEG_INFINITY);
    l.fill(0.0);

    // This task's share of the keys.
    let (mut ks, mut ke) = (lo_all, hi_all);
    if ks < ke && plan.nsplit > 1 {
        let chunk = (ke - ks).div_ceil(plan.nsplit).next_multiple_of(BK);
        ks = (lo_all + t.split * chunk).min(hi_all);
        ke = (ks + chunk).min(hi_all);
    }

    let (mk, mr) = (S::MR, S::MR);
    let lanes = S::LANES;
    let nvec = rp / lanes;
    assert!(nvec <= MAX_VECS);
    let mut j0 = ks;
    while j0 < ke {
        let n = BK.min(ke - j0);
        // Per vector of rows: the first key any of its rows sees (usize::MAX if none), the end
        // of its rows' keys, and whether every row sees the whole tile; gathered here once a tile
        // rather than by a scan of the rows in each loop below.
        let mut vlo = [usize::MAX; MAX_VECS];
        let mut vhi = [0usize; MAX_VECS];
        let mut vfull = [true; MAX_VECS];
        for r in 0..rp {
            a[r] = lo[r].clamp(j0, j0 + n) - j0;
            e[r] = hi[r].clamp(j0, j0 + n) - j0;
            if lo[r] >= hi[r] {
                (a[r], e[r]) = (0, 0);
            }
            af[r] = a[r] as f32;
            ef[r] = e[r] as f32;
            let v = r / lanes;
            if a[r] < e[r] {
                vlo[v] = vlo[v].min(a[r]);
            }
            vhi[v] = vhi[v].max(e[r]);
            vfull[v] &= a[r] == 0 && e[r] == n;
        }
        // The keys any row sees.
        let ua = vlo[..nvec].iter().copied().min().unwrap_or(usize::MAX);
        if ua == usize::MAX {
            j0 += n;
            continue;
        }
        let ue = vhi[..nvec].iter().copied().max().unwrap_or(0);
        // kv heads innermost: the heads of one token are adjacent in memory, so a task over
        // several heads reads whole token rows (decode).
        for x in 0..rw.nkh {
            let kh = rw.kh0 + x;
            let qt = &qt[x * d * rs..(x + 1) * d * rs];
            let o = &mut o[x * rp * dp..(x + 1) * rp * dp];
            let (m, l) = (&mut m[x * rp..(x + 1) * rp], &mut l[x * rp..(x + 1) * rp]);
            let (alpha, slope) = (&mut alpha[x * rp..(x + 1) * rp], &slope[x * rp..(x + 1) * rp]);

            if direct {
                // Decode: s = q·k per key straight from the cache row, v packed for p·v, and the
                // same key of the next tile asked for (spread over the tile, as below).
                let qx = &qr[x * DIRECT_ROWS * dp..(x + 1) * DIRECT_ROWS * dp];
                for jj in ua..ue {
                    let kr = (c.k_row(t.b, seq, j0 + jj) * hkv + kh) * d;
                    let jn = j0 + BK + jj;
                    if jn < ke {
                        prefetch_kv::<S, T>(ctx, (c.k_row(t.b, seq, jn) * hkv + kh) * d);
                    }
                    // SAFETY: `S` is present; qx holds `rows` rows of `dp >= d`; the k row has `d`
                    // elements; row jj of `s` has rp == LANES elements (rows <= 4).
                    unsafe {
                        let (qp, kp, sp) = (qx.as_ptr(), ctx.k[kr..kr + d].as_ptr(), s.as_mut_ptr().add(jj * rs));
                        match rows {
                            1 => dot_rows::<S, T, 1>(qp, dp, kp, d, sp),
                            2 => dot_rows::<S, T, 2>(qp, dp, kp, d, sp),
                            3 => dot_rows::<S, T, 3>(qp, dp, kp, d, sp),
                            _ => dot_rows::<S, T, 4>(qp, dp, kp, d, sp),
                        }
                        pack_row::<S, T>(&ctx.v[kr..kr + d], d, &mut vp[jj * dp..(jj + 1) * dp]);
                    }
                }
            } else {
                // Pack the tile once for all rows of this kv head.
                for jj in ua..ue {
                    let kr = (c.k_row(t.b, seq, j0 + jj) * hkv + kh) * d;
                    // SAFETY: `S` is present.
                    unsafe {
                        pack_row::<S, T>(&ctx.k[kr..kr + d], d, &mut kp[jj * dp..(jj + 1) * dp]);
                        pack_row::<S, T>(&ctx.v[kr..kr + d], d, &mut vp[jj * dp..(jj + 1) * dp]);
                    }
                }
            }

            // s = k·qᵀ, per chunk of rows over the keys those rows see, MR keys at a time (the
            // direct path has them already).
            let mut r0 = if direct { rp } else { 0 };
            while r0 < rp {
                let nr = if r0 + 2 * lanes <= rp { 2 } else { 1 };
                let v = r0 / lanes;
                let ca = vlo[v..v + nr].iter().copied().min().unwrap_or(usize::MAX);
                if ca != usize::MAX {
                    let ce = vhi[v..v + nr].iter().copied().max().unwrap_or(0);
                    let dims = (rs, dp, d);
                    // Keys ca..ce in groups of MR (the packed tile has BK rows, a multiple of MR).
                    let mut j = ca / mk * mk;
                    while j < ce {
                        // Ask for these keys of the next tile now, spread over the tile's work:
                        // per-head (and paged) rows are short strided runs the hardware
                        // prefetchers miss, and a burst of them at pack time overflows the queue.
                        if r0 == 0 {
                            for jn in j0 + BK + j..(j0 + BK + j + mk).min(ke) {
                                prefetch_kv::<S, T>(ctx, (c.k_row(t.b, seq, jn) * hkv + kh) * d);
                            }
                        }
                        // SAFETY: j + MR <= BK rows of kp and s; r0 + nr * LANES <= rp.
                        unsafe {
                            match (mk, nr) {
                                (8, 2) => qk::<S, 8, 2>(qt.as_ptr(), kp.as_ptr(), s.as_mut_ptr(), dims, r0, j),
                                (8, _) => qk::<S, 8, 1>(qt.as_ptr(), kp.as_ptr(), s.as_mut_ptr(), dims, r0, j),
                                (_, 2) => qk::<S, 4, 2>(qt.as_ptr(), kp.as_ptr(), s.as_mut_ptr(), dims, r0, j),
                                _ => qk::<S, 4, 1>(qt.as_ptr(), kp.as_ptr(), s.as_mut_ptr(), dims, r0, j),
                            }
                        }
                        j += mk;
                    }
                }
                r0 += nr * lanes;
            }

            // Online softmax down the key axis, a vector of rows at a time.
            for r0 in (0..rp).step_by(lanes) {
                let rr = r0..r0 + lanes;
                let (va, ve, full) = (vlo[r0 / lanes], vhi[r0 / lanes], vfull[r0 / lanes]);
                if va == usize::MAX {
                    alpha[r0..r0 + lanes].fill(1.0);
                    continue;
                }
                if slow {
                    for j in va..ve {
                        for r in rr.clone() {
                            let x = &mut s[j * rs + r];
                            if j < a[r] || j >= e[r] {
                                *x = f32::NEG_INFINITY;
                                continue;
                            }
                            let mut y = *x * c.scale;
                            if let Some(cap) = p.softcap {
                                y = cap * (y / cap).tanh();
                            }
                            y -= slope[r] * (ia[r] - (j0 + j) as f32).abs();
                            *x = y * log2e;
                        }
                    }
                }
                // SAFETY: every access is a row j < BK of `s` at lanes r0..r0 + LANES <= rp, or
                // r0..r0 + LANES of the per-row buffers.
                unsafe {
                    let sp = s.as_mut_ptr();
                    let (avec, evec) = (S::load(af.as_ptr().add(r0)), S::load(ef.as_ptr().add(r0)));
                    let mut mx = S::splat(f32::NEG_INFINITY);
                    if full || slow {
                        for j in va..ve {
                            mx = S::max(mx, S::load(sp.add(j * rs + r0)));
                        }
                    } else {
                        for j in va..ve {
                            let x = S::mask_range(S::load(sp.add(j * rs + r0)), j as f32, avec, evec);
                            S::store(sp.add(j * rs + r0), x);
                            mx = S::max(mx, x);
                        }
                    }
                    let m_old = S::load(m.as_ptr().add(r0));
                    let m_new = S::max(m_old, mx);
                    let m_use = S::neg_inf_to_zero(m_new);
                    let al = S::exp2(S::sub(m_old, m_use));
                    let mut sum = S::zero();
                    for j in va..ve {
                        let x = S::exp2(S::sub(S::load(sp.add(j * rs + r0)), m_use));
                        S::store(sp.add(j * rs + r0), x);
                        sum = S::add(sum, x);
                    }
                    S::store(m.as_mut_ptr().add(r0), m_new);
                    S::store(l.as_mut_ptr().add(r0), S::fma(S::load(l.as_ptr().add(r0)), al, sum));
                    S::store(alpha.as_mut_ptr().add(r0), al);
                }
            }

            // o = o * alpha + p·v.
            for r in 0..rows {
                if alpha[r] != 1.0 {
                    let f = alpha[r];
                    o[r * dp..(r + 1) * dp].iter_mut().for_each(|x| *x *= f);
                }
            }
            let dims = (rs, dp);
            let (sp, vpp, op) = (s.as_ptr(), vp.as_ptr(), o.as_mut_ptr());
            let mut r0 = 0;
            while r0 < rows {
                // A last group of at most 4 rows (decode: one position x a GQA group of 4) takes
                // the 4-row tile rather than padding to 8.
                let take = if mr == 8 && rows - r0 <= 4 { 4 } else { mr };
                let rr = r0..r0 + take;
                let ca = rr.clone().map(|r| a[r]).max().unwrap_or(0);
                let ce = rr.clone().map(|r| e[r]).min().unwrap_or(0);
                // SAFETY: keys < n <= BK rows of s and vp; rows r0 + MR <= rp; dp a multiple of LANES.
                unsafe {
                    if ca < ce {
                        match take {
                            8 => pv_rows::<S, 8>(sp, vpp, op, dims, r0, (ca, ce)),
                            _ => pv_rows::<S, 4>(sp, vpp, op, dims, r0, (ca, ce)),
                        }
                    }
                    for r in rr.filter(|&r| r < rows) {
                        let (ra, re) = (a[r], e[r]);
                        if ra >= re {
                            continue;
                        }
                        if ca < ce {
                            if ra < ca {
                                pv_rows::<S, 1>(sp, vpp, op, dims, r, (ra, ca));
                            }
                            if ce < re {
                                pv_rows::<S, 1>(sp, vpp, op, dims, r, (ce, re));
                            }
                        } else {
                            pv_rows::<S, 1>(sp, vpp, op, dims, r, (ra, re));
                        }
                    }
                }
                r0 += take;
            }
        }
        j0 += n;
    }

    // Write the rows: final outputs, or this split's partial slot.
    if plan.nsplit > 1 {
        // SAFETY: slot `t.slot` belongs to this task alone and lies inside partial (sized by plan).
        let slot = unsafe { ctx.partial.slice(t.slot * plan.slot(), plan.slot()) };
        let prp = plan.rp;
        for x in 0..rw.nkh {
            for r in 0..rows {
                let (pr, sr) = (x * rows + r, x * rp + r);
                slot[pr] = m[sr];
                slot[prp + pr] = l[sr];
                slot[2 * prp + pr * dp..2 * prp + (pr + 1) * dp].copy_from_slice(&o[sr * dp..(sr + 1) * dp]);
            }
        }
        return;
    }
    for x in 0..rw.nkh {
        for r in 0..rows {
            let sr = x * rp + r;
            // SAFETY: `S` is present (the caller's promise); the row has `dp` elements.
            unsafe { write_row::<S, T>(ctx, t.b, seq, rw.at(c, x, r), &o[sr * dp..(sr + 1) * dp], (m[sr], l[sr])) };
        }
    }
}

/// Normalise and store one output row (and its lse); `m` is in log2 units. `o` holds the row
/// padded to a whole number of vectors (`d` rounded up to `S::LANES` or more).
///
/// # Safety
/// `S`'s instruction set is present.
#[inline(always)]
unsafe fn write_row<S: Simd, T: Element>(
    ctx: &Ctx<'_, T>,
    b: usize,
    seq: &Seq,
    (i, h): (usize, usize),
    o: &[f32],
    (m, l): (f32, f32),
) {
    let c = ctx.c;
    let d = c.d;
    assert!(o.len() >= d.next_multiple_of(S::LANES));
    let base = ((seq.q_start + i) * c.hq + h) * d;
    // SAFETY: row (seq, i, h) of out belongs to this task (or merge group) alone.
    let dst = unsafe { ctx.out.slice(base, d) };
    let lse = if l > 0.0 {
        let inv = 1.0 / l;
        let whole = d - d % S::LANES;
        // SAFETY: `S` is present; o has `whole` elements and more, dst `whole`, vector by vector.
        unsafe {
            let f = S::splat(inv);
            for y in (0..whole).step_by(S::LANES) {
                T::store::<S>(dst.as_mut_ptr().add(y), S::mul(S::load(o.as_ptr().add(y)), f));
            }
        }
        for y in whole..d {
            dst[y] = T::narrow(o[y] * inv);
        }
        (m + l.log2()) * std::f32::consts::LN_2
    } else {
        dst.fill(T::ZERO);
        f32::NEG_INFINITY
    };
    if let Some(ls) = ctx.lse {
        // SAFETY: lse index (seq, h, i) belongs to this task alone.
        unsafe { ls.slice(c.lse_index(b, seq, h, i), 1)[0] = lse };
    }
}

/// Merge the key splits of group `grp` of sequence `b` (partial slots from `gslot * nsplit`).
fn merge<T: Element>(ctx: &Ctx<'_, T>, b: usize, seq: &Seq, grp: usize, gslot: usize, sc: &mut Scratch) {
    let c = ctx.c;
    let plan = ctx.plan;
    let (dp, prp, ns) = (plan.dp, plan.rp, plan.nsplit);
    let rw = Rows::of(c, &plan, seq, grp);
    let per = rw.per_head();
    let acc = sc.o.get(dp);
    let size = plan.slot();
    // SAFETY: the splits' slots of this group are read by this merge alone, after every task joined.
    let slots = unsafe { ctx.partial.slice(gslot * ns * size, ns * size) };
    for r in 0..rw.nkh * per {
        let mmax = (0..ns).map(|x| slots[x * size + r]).fold(f32::NEG_INFINITY, f32::max);
        acc.fill(0.0);
        let mut lsum = 0.0;
        if mmax > f32::NEG_INFINITY {
            for x in 0..ns {
                let sl = &slots[x * size..(x + 1) * size];
                let (ms, ls) = (sl[r], sl[prp + r]);
                if ls == 0.0 {
                    continue;
                }
                let w = (ms - mmax).exp2();
                lsum += ls * w;
                for (y, &z) in acc.iter_mut().zip(&sl[2 * prp + r * dp..2 * prp + (r + 1) * dp]) {
                    *y += z * w;
                }
            }
        }
        // SAFETY: the portable set needs nothing beyond the target's baseline; acc has `dp`
        // elements, a multiple of every set's lanes.
        unsafe { write_row::<Portable, T>(ctx, b, seq, rw.at(c, r / per, r % per), acc, (mmax, lsum)) };
    }
}
