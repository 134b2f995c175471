//! attnkit's `cpu` backend against candle on the same inputs, in the same process.
//!
//! Peers: candle's matmul-softmax-matmul attention (`q·kᵀ`, `softmax_last_dim`, `·v`, the head
//! transposes included since the inputs are `[B, S, H, D]` as for attnkit) and candle-nn's
//! `attention::cpu_flash::flash_attn`. After criterion's report, each case runs again as
//! interleaved rounds (attnkit, its peers, the FMA peak, in turn, so load from elsewhere on a
//! shared machine hits them alike; each timed call after an untimed one of its own, but candle's
//! cpu_flash, at one to four seconds a call), and a table prints the medians: attnkit's GFLOP/s
//! and fraction of the FMA peak of the same rounds, and the ratios. Decode (paged, Sq = 1) is compared with a
//! plain memory copy on the same machine.
//!
//! `cargo bench --features cpu --bench cpu -- --warm-up-time 1 --measurement-time 3`
//! A criterion filter after `--` narrows the cases (`f32`, `decode`, ...). candle's cpu_flash at
//! f16/bf16 takes about a minute per call at these shapes; set `ATTNKIT_BENCH_SLOW_PEERS=1` to run it.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use attnkit::{AttentionBackend, AttnCall, DType, Tensor};
use candle_core::{Device, Tensor as CTensor};
use criterion::Criterion;
use rayon::prelude::*;

/// Median seconds per call of every benchmark id, filled by the timing closures.
static TIMES: Mutex<BTreeMap<String, Vec<f64>>> = Mutex::new(BTreeMap::new());

fn record(id: &str, iters: u64, d: Duration) {
    TIMES.lock().unwrap().entry(id.to_string()).or_default().push(d.as_secs_f64() / iters as f64);
}

fn median(id: &str) -> Option<f64> {
    let t = TIMES.lock().unwrap();
    let mut v = t.get(id)?.clone();
    v.sort_by(f64::total_cmp);
    Some(v[v.len() / 2])
}

/// Rounds of the interleaved measurement behind the summary table (`ATTNKIT_BENCH_ROUNDS`, 5).
fn rounds() -> usize {
    std::env::var("ATTNKIT_BENCH_ROUNDS").ok().and_then(|s| s.parse().ok()).unwrap_or(5)
}

/// Seconds of one call.
fn once(mut f: impl FnMut()) -> f64 {
    let t = Instant::now();
    f();
    t.elapsed().as_secs_f64()
}

fn record_secs(id: &str, secs: f64) {
    TIMES.lock().unwrap().entry(id.to_string()).or_default().push(secs);
}

/// splitmix64 uniform in [-amp, amp): random, never zeros.
fn random(n: usize, seed: u64, amp: f32) -> Vec<f32> {
    let mut s = seed ^ 0x9E37_79B9_7F4A_7C15;
    (0..n)
        .map(|_| {
            s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            ((z >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * amp
        })
        .collect()
}

fn cdtype(d: DType) -> candle_core::DType {
    match d {
        DType::F32 => candle_core::DType::F32,
        DType::F16 => candle_core::DType::F16,
        DType::BF16 => candle_core::DType::BF16,
        DType::I32 => unreachable!(),
    }
}

/// FLOPs of attention over the visible (query, key) pairs: 2·D for q·k and 2·D for p·v.
fn flops(h: usize, s: usize, d: usize, causal: bool) -> f64 {
    let pairs = if causal { s * (s + 1) / 2 } else { s * s };
    4.0 * (h * pairs * d) as f64
}

struct Case {
    h: usize,
    s: usize,
    d: usize,
    dtype: DType,
    causal: bool,
}

impl Case {
    fn id(&self) -> String {
        format!("1x{}x{}x{}/{}/{}", self.h, self.s, self.d, self.dtype, if self.causal { "causal" } else { "full" })
    }
}

fn candle_matmul(q: &CTensor, k: &CTensor, v: &CTensor, scale: f64, mask: Option<&CTensor>) -> CTensor {
    let q = q.transpose(1, 2).unwrap().contiguous().unwrap();
    let k = k.transpose(1, 2).unwrap().contiguous().unwrap();
    let v = v.transpose(1, 2).unwrap().contiguous().unwrap();
    let att = (q.matmul(&k.t().unwrap()).unwrap() * scale).unwrap();
    let att = match mask {
        Some(m) => att.broadcast_add(m).unwrap(),
        None => att,
    };
    let att = candle_nn::ops::softmax_last_dim(&att).unwrap();
    att.matmul(&v).unwrap()
}

fn candle_flash(q: &CTensor, k: &CTensor, v: &CTensor, scale: f32, causal: bool) -> CTensor {
    use candle_nn::attention::{flash_attn, AttnMask};
    let mask = if causal { AttnMask::causal() } else { AttnMask::None };
    match q.dtype() {
        candle_core::DType::F32 => flash_attn::<f32>(q, k, v, scale, mask, None, None),
        candle_core::DType::F16 => flash_attn::<half::f16>(q, k, v, scale, mask, None, None),
        _ => flash_attn::<half::bf16>(q, k, v, scale, mask, None, None),
    }
    .unwrap()
}

fn bench_prefill(c: &mut Criterion, case: &Case) {
    let (h, s, d) = (case.h, case.s, case.d);
    let n = s * h * d;
    let (qf, kf, vf) = (random(n, 1, 1.5), random(n, 2, 1.5), random(n, 3, 1.0));
    let shape = [1, s, h, d];
    let be = attnkit::cpu::CpuBackend::new().unwrap();
    let q = Tensor::from_f32(&shape, case.dtype, &qf).unwrap();
    let k = Tensor::from_f32(&shape, case.dtype, &kf).unwrap();
    let v = Tensor::from_f32(&shape, case.dtype, &vf).unwrap();
    let mut out = be.alloc(&shape, case.dtype).unwrap();
    let call = AttnCall::dense(&q, &k, &v).causal(case.causal);

    let dev = Device::Cpu;
    let ct = |x: &[f32]| CTensor::from_slice(x, (1, s, h, d), &dev).unwrap().to_dtype(cdtype(case.dtype)).unwrap();
    let (cq, ck, cv) = (ct(&qf), ct(&kf), ct(&vf));
    let mask = case.causal.then(|| {
        let m: Vec<f32> = (0..s * s).map(|x| if x % s > x / s { f32::NEG_INFINITY } else { 0.0 }).collect();
        CTensor::from_vec(m, (s, s), &dev).unwrap().to_dtype(cdtype(case.dtype)).unwrap()
    });
    let scale = 1.0 / (d as f64).sqrt();

    let id = case.id();
    let mut g = c.benchmark_group(&id);
    g.sample_size(10);
    let key = format!("{id}/attnkit");
    g.bench_function("attnkit", |b| {
        b.iter_custom(|iters| {
            let t = Instant::now();
            for _ in 0..iters {
                be.forward(&call, Some(&mut out), None).unwrap();
            }
            let e = t.elapsed();
            record(&key, iters, e);
            e
        })
    });
    let key = format!("{id}/candle_matmul");
    g.bench_function("candle_matmul", |b| {
        b.iter_custom(|iters| {
            let t = Instant::now();
            for _ in 0..iters {
                std::hint::black_box(candle_matmul(&cq, &ck, &cv, scale, mask.as_ref()));
            }
            let e = t.elapsed();
            record(&key, iters, e);
            e
        })
    });
    if case.dtype == DType::F32 || std::env::var("ATTNKIT_BENCH_SLOW_PEERS").is_ok() {
        let key = format!("{id}/candle_flash");
        g.bench_function("candle_flash", |b| {
            b.iter_custom(|iters| {
                let t = Instant::now();
                for _ in 0..iters {
                    std::hint::black_box(candle_flash(&cq, &ck, &cv, scale as f32, case.causal));
                }
                let e = t.elapsed();
                record(&key, iters, e);
                e
            })
        });
    }
    g.finish();

    // The table: attnkit and its peers called in turn, round after round, with the FMA peak
    // measured in each round too, so a load that comes and goes on a shared machine hits all of
    // them alike. Only when criterion ran this case (a filter may have skipped it).
    if median(&format!("{id}/attnkit")).is_none() {
        return;
    }
    let full = AttnCall::dense(&q, &k, &v);
    for _ in 0..rounds() {
        // Each call timed here follows an untimed call of itself: the peers and the peak loop
        // before it leave the caches and page tables cold, which cost a single timed call up to 8%
        // (seen at 1x8x2048x64 f32: 46.8 ms in the rounds against criterion's 43.3).
        let mut attnkit = |c: &AttnCall<'_>| once(|| drop(be.forward(c, Some(&mut out), None).unwrap()));
        attnkit(&call);
        let ta = attnkit(&call);
        record_secs(&format!("il/{id}/attnkit"), ta);
        if case.causal {
            // The ratio of the causal and full-mask calls timed back to back, in the order causal,
            // full, full, causal (each call's position once first, once second after a warm call),
            // so that a load that comes and goes between rounds moves both alike and neither
            // gains from the order.
            let (f1, f2) = (attnkit(&full), attnkit(&full));
            let ta2 = attnkit(&call);
            record_secs(&format!("il/{id}/causal_ratio"), (ta + ta2) / (f1 + f2));
        }
        let matmul = || once(|| drop(std::hint::black_box(candle_matmul(&cq, &ck, &cv, scale, mask.as_ref()))));
        matmul();
        record_secs(&format!("il/{id}/candle_matmul"), matmul());
        if case.dtype == DType::F32 || std::env::var("ATTNKIT_BENCH_SLOW_PEERS").is_ok() {
            record_secs(
                &format!("il/{id}/candle_flash"),
                once(|| drop(std::hint::black_box(candle_flash(&cq, &ck, &cv, scale as f32, case.causal)))),
            );
        }
        record_secs(&format!("il/{id}/peak"), attnkit::cpu::fma_peak_gflops().0);
    }
}

/// Decode: Sq = 1, Hq 32 / Hkv 8, D 128, f16, paged with blocks of 16 in shuffled order.
const DEC: (usize, usize, usize, usize, usize) = (32, 8, 128, 16, 32768);

fn decode_bytes() -> f64 {
    let (_, hkv, d, _, sk) = DEC;
    (2 * sk * hkv * d * 2) as f64
}

fn bench_decode(c: &mut Criterion) {
    let (hq, hkv, d, bs, sk) = DEC;
    let nb = sk / bs;
    let be = attnkit::cpu::CpuBackend::new().unwrap();
    let q = Tensor::from_f32(&[1, hq, d], DType::F16, &random(hq * d, 4, 1.5)).unwrap();
    let kc = Tensor::from_f32(&[nb, bs, hkv, d], DType::F16, &random(nb * bs * hkv * d, 5, 1.5)).unwrap();
    let vc = Tensor::from_f32(&[nb, bs, hkv, d], DType::F16, &random(nb * bs * hkv * d, 6, 1.0)).unwrap();
    // A shuffled block table (a multiplicative permutation of 0..nb).
    let table: Vec<i32> = (0..nb).map(|i| ((i * 1237 + 11) % nb) as i32).collect();
    let cu_q = [0, 1];
    let seq_lens = [sk as i32];
    let call = AttnCall::paged(&q, &kc, &vc, &cu_q, &table, nb, &seq_lens);
    let mut out = be.alloc(&[1, hq, d], DType::F16).unwrap();

    // The peer: a plain copy of as many bytes as the kernel reads, split over the rayon threads.
    let bytes = decode_bytes() as usize;
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    let chunk = bytes.div_ceil(rayon::current_num_threads() * 4);

    let mut g = c.benchmark_group("decode/1x32x8x128/paged16/sk32768/f16");
    g.sample_size(20);
    g.bench_function("attnkit", |b| {
        b.iter_custom(|iters| {
            let t = Instant::now();
            for _ in 0..iters {
                be.forward(&call, Some(&mut out), None).unwrap();
            }
            let e = t.elapsed();
            record("decode/attnkit", iters, e);
            e
        })
    });
    g.bench_function("memcpy", |b| {
        b.iter_custom(|iters| {
            let t = Instant::now();
            for _ in 0..iters {
                dst.par_chunks_mut(chunk).zip(src.par_chunks(chunk)).for_each(|(d, s)| d.copy_from_slice(s));
                std::hint::black_box(&mut dst);
            }
            let e = t.elapsed();
            record("decode/memcpy", iters, e);
            e
        })
    });
    g.finish();
    if median("decode/attnkit").is_none() {
        return;
    }
    for _ in 0..4 * rounds() {
        record_secs("il/decode/attnkit", once(|| drop(be.forward(&call, Some(&mut out), None).unwrap())));
        record_secs(
            "il/decode/memcpy",
            once(|| {
                dst.par_chunks_mut(chunk).zip(src.par_chunks(chunk)).for_each(|(d, s)| d.copy_from_slice(s));
                std::hint::black_box(&mut dst);
            }),
        );
    }
}

fn cases() -> Vec<Case> {
    let mut v = Vec::new();
    for (h, d) in [(8, 64), (16, 128)] {
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            for causal in [false, true] {
                v.push(Case { h, s: 2048, d, dtype, causal });
            }
        }
    }
    v
}

fn summary(isa: &str) {
    let ms = |x: Option<f64>| x.map_or("-".to_string(), |t| format!("{:.1}", t * 1e3));
    let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) => format!("{:.2}x", b / a),
        _ => "-".into(),
    };
    println!(
        "\nMedians of {} interleaved rounds per case ({isa}, {} threads); the FMA peak is measured in the same rounds.",
        rounds(),
        rayon::current_num_threads()
    );
    println!(
        "| case (B x H x S x D / dtype / mask) | attnkit ms | GFLOP/s | FMA peak GFLOP/s | of FMA peak | candle matmul ms | speedup | candle cpu_flash ms | speedup | vs candle f16 matmul | causal / full time | same, criterion's medians |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    for c in cases() {
        let id = c.id();
        let a = median(&format!("il/{id}/attnkit"));
        let m = median(&format!("il/{id}/candle_matmul"));
        let f = median(&format!("il/{id}/candle_flash"));
        // The target for f16 and bf16 inputs: against candle's f16 matmul-softmax at the
        // same shape and mask (for bf16 rows this is not candle's bf16 path of the column before).
        let m16 = match c.dtype {
            DType::F32 => None,
            _ => median(&format!("il/{}/candle_matmul", Case { dtype: DType::F16, ..c }.id())),
        };
        let peak = median(&format!("il/{id}/peak"));
        if a.is_none() {
            continue;
        }
        let gf = a.map(|t| flops(c.h, c.s, c.d, c.causal) / t / 1e9);
        // The median of the rounds' causal / full ratios (each pair timed back to back).
        let cr = match (c.causal, median(&format!("il/{id}/causal_ratio"))) {
            (true, Some(r)) => format!("{r:.3}"),
            _ => String::new(),
        };
        // The same ratio from criterion's runs: the medians of many back-to-back calls of each.
        let crit = match (c.causal, median(&format!("{id}/attnkit"))) {
            (true, Some(tc)) => median(&format!("{}/attnkit", Case { causal: false, ..c }.id()))
                .map_or(String::new(), |tf| format!("{:.3}", tc / tf)),
            _ => String::new(),
        };
        println!(
            "| {id} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {cr} | {crit} |",
            ms(a),
            gf.map_or("-".into(), |g| format!("{g:.1}")),
            peak.map_or("-".into(), |p| format!("{p:.0}")),
            match (gf, peak) {
                (Some(g), Some(p)) => format!("{:.1}%", 100.0 * g / p),
                _ => "-".into(),
            },
            ms(m),
            ratio(a, m),
            ms(f),
            ratio(a, f),
            if m16.is_some() { ratio(a, m16) } else { String::new() }
        );
    }
    if let (Some(a), Some(m)) = (median("il/decode/attnkit"), median("il/decode/memcpy")) {
        let b = decode_bytes();
        println!(
            "decode Sq=1 Hq32/Hkv8 D128 paged16 Sk32768 f16 ({} interleaved rounds): attnkit {:.2} ms = {:.1} GB/s of K+V read; memcpy of the same bytes {:.2} ms = {:.1} GB/s copied; attnkit reads at {:.0}% of the copy rate",
            4 * rounds(),
            a * 1e3,
            b / a / 1e9,
            m * 1e3,
            b / m / 1e9,
            100.0 * m / a
        );
    }
}

fn status_kib(field: &str) -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with(field))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// Peak resident memory that one forward over (1, 8, 16384, 64) f32 adds above its inputs and
/// output (Linux: the peak is reset through /proc/self/clear_refs). `None` elsewhere.
fn extra_memory() -> Option<(f64, f64)> {
    let (h, s, d) = (8, 16384, 64);
    let shape = [1, s, h, d];
    let be = attnkit::cpu::CpuBackend::new().unwrap();
    let n = s * h * d;
    let q = Tensor::from_f32(&shape, DType::F32, &random(n, 7, 1.5)).unwrap();
    let k = Tensor::from_f32(&shape, DType::F32, &random(n, 8, 1.5)).unwrap();
    let v = Tensor::from_f32(&shape, DType::F32, &random(n, 9, 1.0)).unwrap();
    let mut out = be.alloc(&shape, DType::F32).unwrap();
    if let Some(o) = out.host_mut() {
        *o = attnkit::HostData::F32(vec![0.5; n]); // touch every page of the output
    }
    std::fs::write("/proc/self/clear_refs", "5").ok()?;
    let before = status_kib("VmRSS:")?;
    let t = Instant::now();
    be.forward(&AttnCall::dense(&q, &k, &v), Some(&mut out), None).unwrap();
    let secs = t.elapsed().as_secs_f64();
    let peak = status_kib("VmHWM:")?;
    Some((peak.saturating_sub(before) as f64 / 1024.0, secs))
}

fn main() {
    let mem = extra_memory();
    let isa = attnkit::cpu::fma_peak_gflops().1;
    let mut c = Criterion::default().sample_size(10).configure_from_args();
    for case in cases() {
        bench_prefill(&mut c, &case);
    }
    bench_decode(&mut c);
    c.final_summary();
    summary(isa);
    match mem {
        Some((mib, secs)) => println!(
            "extra peak resident memory of one forward over (1, 8, 16384, 64) f32 (inputs + output 128 MiB): {mib:.1} MiB ({secs:.2} s)"
        ),
        None => println!("extra peak resident memory: not measurable here (needs Linux /proc)"),
    }
}
