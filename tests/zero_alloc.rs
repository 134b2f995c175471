//! The cpu backend allocates nothing on the heap inside `forward` when the caller gives `out` and
//! `lse`, once warm; nor does the cuda backend (with a device; metadata unchanged since the last
//! call, split-KV workspace grown). A counting global allocator (this binary's own) counts every allocation on
//! every thread, rayon's workers included, while a window is open.
//!
//! The tests of this binary share one process-wide counter, so they take a lock and run one at a
//! time. The first allocation inside a window records its backtrace, so a failure says where.

use std::alloc::{GlobalAlloc, Layout as AllocLayout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;

use attnkit::{AttentionBackend, AttnCall, DType, LayoutKind, Params, Tensor};

#[cfg(feature = "cuda")]
mod common;

struct Counting;

static COUNTING: AtomicBool = AtomicBool::new(false);
static ALLOCS: AtomicUsize = AtomicUsize::new(0);
static BYTES: AtomicUsize = AtomicUsize::new(0);
static FIRST_TRACE: Mutex<Option<String>> = Mutex::new(None);
static WANT_TRACE: AtomicBool = AtomicBool::new(false);

thread_local! {
    // Set while this thread records a backtrace, whose own allocations are not counted.
    static IN_TRACE: Cell<bool> = const { Cell::new(false) };
}

impl Counting {
    fn note(&self, size: usize) {
        if !COUNTING.load(Ordering::SeqCst) {
            return;
        }
        if IN_TRACE.with(|t| t.get()) {
            return;
        }
        ALLOCS.fetch_add(1, Ordering::SeqCst);
        BYTES.fetch_add(size, Ordering::SeqCst);
        if WANT_TRACE.swap(false, Ordering::SeqCst) {
            IN_TRACE.with(|t| t.set(true));
            let bt = std::backtrace::Backtrace::force_capture().to_string();
            let who = std::thread::current().name().unwrap_or("<unnamed>").to_string();
            if let Ok(mut g) = FIRST_TRACE.try_lock() {
                *g = Some(format!("first allocation: {size} bytes on thread `{who}`\n{bt}"));
            }
            IN_TRACE.with(|t| t.set(false));
        }
    }
}

// SAFETY: every method forwards to the system allocator unchanged; counting only touches atomics
// and, once per window, records a backtrace with counting turned off for that thread.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: AllocLayout) -> *mut u8 {
        self.note(layout.size());
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: AllocLayout) -> *mut u8 {
        self.note(layout.size());
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: AllocLayout, new_size: usize) -> *mut u8 {
        self.note(new_size);
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: AllocLayout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Serialises the tests of this binary: the counter is process-wide.
static LOCK: Mutex<()> = Mutex::new(());

/// Allocations (count, bytes, first backtrace) made by any thread while `f` runs.
fn count<R>(f: impl FnOnce() -> R) -> (usize, usize, Option<String>, R) {
    *FIRST_TRACE.lock().unwrap() = None;
    ALLOCS.store(0, Ordering::SeqCst);
    BYTES.store(0, Ordering::SeqCst);
    WANT_TRACE.store(true, Ordering::SeqCst);
    COUNTING.store(true, Ordering::SeqCst);
    let r = f();
    COUNTING.store(false, Ordering::SeqCst);
    WANT_TRACE.store(false, Ordering::SeqCst);
    let trace = FIRST_TRACE.lock().unwrap().take();
    (ALLOCS.load(Ordering::SeqCst), BYTES.load(Ordering::SeqCst), trace, r)
}

/// One call's inputs, host tensors, random and never zero.
struct Inputs {
    name: String,
    layout: LayoutKind,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_q: Vec<i32>,
    cu_k: Vec<i32>,
    block_table: Vec<i32>,
    max_blocks: usize,
    seq_lens: Vec<i32>,
    slopes: Vec<f32>,
    alibi: bool,
    params: Params,
}

fn rand_vec(seed: &mut u64, n: usize) -> Vec<f64> {
    (0..n)
        .map(|_| {
            *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((*seed >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
        })
        .collect()
}

#[allow(clippy::too_many_arguments)]
fn inputs(
    name: &str,
    layout: LayoutKind,
    dtype: DType,
    lens: &[(usize, usize)],
    hkv: usize,
    group: usize,
    d: usize,
    params: Params,
    alibi: bool,
) -> Inputs {
    let mut seed = 0x5eed ^ (d as u64 * 31 + lens.len() as u64);
    let hq = hkv * group;
    let b = lens.len();
    let mut cu_q = vec![0i32];
    let mut cu_k = vec![0i32];
    for &(lq, lk) in lens {
        cu_q.push(cu_q.last().unwrap() + lq as i32);
        cu_k.push(cu_k.last().unwrap() + lk as i32);
    }
    let (tq, tk) = (*cu_q.last().unwrap() as usize, *cu_k.last().unwrap() as usize);
    let mut block_table = vec![];
    let mut max_blocks = 0;
    let seq_lens: Vec<i32> = lens.iter().map(|l| l.1 as i32).collect();
    let (q, k, v) = match layout {
        LayoutKind::Dense => {
            let (sq, sk) = lens[0];
            (
                Tensor::from_f64(&[b, sq, hq, d], dtype, &rand_vec(&mut seed, b * sq * hq * d)).unwrap(),
                Tensor::from_f64(&[b, sk, hkv, d], dtype, &rand_vec(&mut seed, b * sk * hkv * d)).unwrap(),
                Tensor::from_f64(&[b, sk, hkv, d], dtype, &rand_vec(&mut seed, b * sk * hkv * d)).unwrap(),
            )
        }
        LayoutKind::Varlen => (
            Tensor::from_f64(&[tq, hq, d], dtype, &rand_vec(&mut seed, tq * hq * d)).unwrap(),
            Tensor::from_f64(&[tk, hkv, d], dtype, &rand_vec(&mut seed, tk * hkv * d)).unwrap(),
            Tensor::from_f64(&[tk, hkv, d], dtype, &rand_vec(&mut seed, tk * hkv * d)).unwrap(),
        ),
        LayoutKind::Paged => {
            let bs = 16;
            max_blocks = lens.iter().map(|l| l.1.div_ceil(bs)).max().unwrap_or(0) + 1;
            let num_blocks = b * max_blocks;
            // Sequence s owns blocks in reverse order, so the table is not the identity.
            for s in 0..b {
                for j in 0..max_blocks {
                    block_table.push((num_blocks - 1 - (s * max_blocks + j)) as i32);
                }
            }
            let n = num_blocks * bs * hkv * d;
            (
                Tensor::from_f64(&[tq, hq, d], dtype, &rand_vec(&mut seed, tq * hq * d)).unwrap(),
                Tensor::from_f64(&[num_blocks, bs, hkv, d], dtype, &rand_vec(&mut seed, n)).unwrap(),
                Tensor::from_f64(&[num_blocks, bs, hkv, d], dtype, &rand_vec(&mut seed, n)).unwrap(),
            )
        }
    };
    let slopes = (0..hq).map(|h| 0.5f32.powi(h as i32 + 1)).collect();
    Inputs {
        name: name.to_string(),
        layout,
        q,
        k,
        v,
        cu_q,
        cu_k,
        block_table,
        max_blocks,
        seq_lens,
        slopes,
        alibi,
        params,
    }
}

impl Inputs {
    fn call(&self) -> AttnCall<'_> {
        let mut c = match self.layout {
            LayoutKind::Dense => AttnCall::dense(&self.q, &self.k, &self.v),
            LayoutKind::Varlen => AttnCall::varlen(&self.q, &self.k, &self.v, &self.cu_q, &self.cu_k),
            LayoutKind::Paged => AttnCall::paged(
                &self.q,
                &self.k,
                &self.v,
                &self.cu_q,
                &self.block_table,
                self.max_blocks,
                &self.seq_lens,
            ),
        };
        c.params = self.params;
        c.alibi_slopes = if self.alibi { Some(&self.slopes) } else { None };
        c
    }
    fn lse_shape(&self) -> Vec<usize> {
        let s = self.q.shape();
        match self.layout {
            LayoutKind::Dense => vec![s[0], s[2], s[1]],
            _ => vec![s[1], s[0]],
        }
    }
}

fn p(causal: bool, wl: Option<usize>, wr: Option<usize>, softcap: Option<f32>, scale: Option<f32>) -> Params {
    Params { causal, window_left: wl, window_right: wr, softcap, scale }
}

/// Dense, varlen and paged; MHA, GQA and MQA; every mask and score option; each dtype.
fn all_inputs() -> Vec<Inputs> {
    use DType::*;
    use LayoutKind::*;
    let none = Params::default();
    vec![
        inputs("dense f32 mha", Dense, F32, &[(64, 64), (64, 64)], 4, 1, 64, none, false),
        inputs("dense f16 gqa causal", Dense, F16, &[(37, 100)], 2, 4, 128, p(true, None, None, None, None), false),
        inputs(
            "dense bf16 mqa window",
            Dense,
            BF16,
            &[(70, 70)],
            1,
            8,
            32,
            p(false, Some(9), Some(3), None, None),
            false,
        ),
        inputs(
            "dense f32 softcap scale",
            Dense,
            F32,
            &[(33, 65)],
            2,
            2,
            80,
            p(true, None, None, Some(5.0), Some(0.2)),
            false,
        ),
        inputs("dense bf16 d=256 alibi", Dense, BF16, &[(16, 40)], 1, 2, 256, p(true, None, None, None, None), true),
        inputs("dense f32 d=3", Dense, F32, &[(5, 7)], 3, 1, 3, none, false),
        inputs(
            "varlen f32 gqa causal window",
            Varlen,
            F32,
            &[(20, 90), (0, 5), (65, 65), (1, 0)],
            2,
            2,
            64,
            p(true, Some(16), None, None, None),
            false,
        ),
        inputs(
            "varlen f16 softcap alibi",
            Varlen,
            F16,
            &[(7, 300), (40, 40)],
            2,
            4,
            96,
            p(false, None, None, Some(30.0), None),
            true,
        ),
        inputs("varlen bf16 mha", Varlen, BF16, &[(33, 33), (2, 129)], 4, 1, 128, none, false),
        inputs("paged f32 decode gqa", Paged, F32, &[(1, 257), (1, 16), (1, 3)], 2, 4, 128, none, false),
        inputs(
            "paged f16 prefill causal window",
            Paged,
            F16,
            &[(40, 100), (8, 8)],
            1,
            4,
            64,
            p(true, Some(32), Some(0), None, None),
            false,
        ),
        inputs(
            "paged bf16 alibi softcap",
            Paged,
            BF16,
            &[(3, 50)],
            2,
            2,
            64,
            p(true, None, None, Some(10.0), None),
            true,
        ),
    ]
}

fn cpu() -> Box<dyn AttentionBackend> {
    attnkit::by_name("cpu").expect("the cpu backend is compiled in")
}

/// Warm the cpu backend on every case, then count allocations over `ROUNDS` calls of each with
/// caller buffers. `on_worker` makes the calls from inside rayon's pool (as a caller already in
/// the pool would), otherwise from this plain thread. Returns the report of every case that
/// allocated.
fn allocations_in_forward(on_worker: bool) -> Vec<String> {
    allocations_in_forward_on(&*cpu(), on_worker)
}

fn allocations_in_forward_on(be: &dyn AttentionBackend, on_worker: bool) -> Vec<String> {
    // The inputs on the backend's device; cases it does not support (a head dim, say) are left
    // out, by name.
    let cases: Vec<Inputs> = all_inputs()
        .into_iter()
        .filter_map(|mut c| {
            c.q = be.upload(&c.q).unwrap();
            c.k = be.upload(&c.k).unwrap();
            c.v = be.upload(&c.v).unwrap();
            if let Err(e) = be.forward(&c.call(), None, None) {
                eprintln!("{}: `{}` left out: {e}", be.name(), c.name);
                return None;
            }
            Some(c)
        })
        .collect();
    assert!(cases.len() >= 8, "{}: only {} cases ran", be.name(), cases.len());
    let calls: Vec<AttnCall<'_>> = cases.iter().map(Inputs::call).collect();
    let mut outs: Vec<(Tensor, Tensor)> = cases
        .iter()
        .map(|c| (be.alloc(c.q.shape(), c.q.dtype()).unwrap(), be.alloc(&c.lse_shape(), DType::F32).unwrap()))
        .collect();
    // Warm: every call several times, from this thread and from inside the pool, so every rayon
    // worker has run tasks of every case and grown its tile scratch for every head dim.
    for _ in 0..8 {
        for (call, (out, lse)) in calls.iter().zip(outs.iter_mut()) {
            be.forward(call, Some(&mut *out), Some(&mut *lse)).unwrap();
            rayon::join(|| be.forward(call, Some(&mut *out), Some(&mut *lse)).unwrap(), || ());
        }
    }
    let mut report = Vec::new();
    // Enough rounds that an allocation amortised over many calls (a queue growing a block every
    // few dozen jobs) shows up too.
    const ROUNDS: usize = 200;
    for (i, (call, (out, lse))) in calls.iter().zip(outs.iter_mut()).enumerate() {
        let many = || {
            for _ in 0..ROUNDS {
                be.forward(call, Some(&mut *out), Some(&mut *lse))?;
            }
            Ok::<(), attnkit::Error>(())
        };
        let (n, bytes, trace, r) = if on_worker {
            // The window opens on the worker, after rayon took the job from this thread.
            rayon::join(|| count(many), || ()).0
        } else {
            count(many)
        };
        r.unwrap();
        be.synchronize().unwrap();
        eprintln!("{} {:32} {ROUNDS} calls: {n} allocations, {bytes} bytes", be.name(), cases[i].name);
        if n > 0 {
            report.push(format!(
                "{}: {n} allocations ({bytes} bytes) in {ROUNDS} calls\n{}",
                cases[i].name,
                trace.unwrap_or_default()
            ));
        }
    }
    report
}

#[test]
fn cpu_forward_with_caller_buffers_allocates_nothing_inside_rayons_pool() {
    let _g = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let report = allocations_in_forward(true);
    assert!(report.is_empty(), "cpu forward allocated with caller buffers:\n{}", report.join("\n"));
}

/// The contract as a model calls it, from its own thread. A rayon loop started from outside a
/// pool would push a job on rayon's global injector, which allocates a block every 63 pushes; the
/// cpu backend hands calls to its own pool through a condition variable instead (`pool.rs`).
#[test]
fn cpu_forward_with_caller_buffers_allocates_nothing_from_a_plain_thread() {
    let _g = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let report = allocations_in_forward(false);
    assert!(report.is_empty(), "cpu forward allocated with caller buffers:\n{}", report.join("\n"));
}

#[test]
fn the_counter_sees_an_allocating_forward() {
    let _g = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let be = cpu();
    let c = &all_inputs()[0];
    let call = c.call();
    let mut lse = be.alloc(&c.lse_shape(), DType::F32).unwrap();
    be.forward(&call, None, Some(&mut lse)).unwrap();
    // Without an out buffer forward must allocate one: the counter has to see it.
    let (n, bytes, _, r) = count(|| be.forward(&call, None, Some(&mut lse)).map(|o| o.out.is_some()));
    assert!(r.unwrap(), "forward(None) returned no out");
    assert!(n >= 1, "the counting allocator missed forward's own allocation of out");
    assert!(bytes >= c.q.elem_count() * 4, "counted {bytes} bytes, less than out's");
    // And on another thread: a rayon worker's allocation is counted too.
    let (n, _, trace, _) = count(|| rayon::join(|| (), || std::hint::black_box(vec![1u8; 100])));
    assert!(n >= 1, "an allocation inside rayon was not counted");
    assert!(trace.is_some_and(|t| t.contains("first allocation")), "no backtrace was recorded");
}

/// Dense, varlen and paged (the metadata mirror), split-KV decode (the workspace), every dtype:
/// once warm, a call with caller buffers allocates nothing on the host, so a serving loop can
/// run it forever (and capture it in a CUDA graph).
#[cfg(feature = "cuda")]
#[test]
fn cuda_forward_with_caller_buffers_allocates_nothing() {
    let _g = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let Some(be) = common::backend("cuda") else { return };
    let report = allocations_in_forward_on(&*be, false);
    assert!(report.is_empty(), "cuda forward allocated with caller buffers:\n{}", report.join("\n"));
}
