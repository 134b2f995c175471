//! CUDA timings with CUDA events on the standard shapes (run explicitly on a GPU):
//!
//!   cargo test --release --features cuda --test cuda_bench -- --ignored --nocapture
//!
//! Prefill: batch * seqlen = 16k tokens, hidden 2048, heads = 2048 / hdim (FlashAttention's
//! benchmark shapes; FLOPs = 4 b h s^2 d, halved when causal). Decode: q_len 1, 32 query heads,
//! hdim 128, bf16, paged blocks of 16; figure = bytes of K and V read / time.
//! ATTNKIT_BENCH_SWEEP=1 also times other split counts and decode tiles, and other tile shapes of
//! the tensor-core kernel (ATTNKIT_BENCH_TILES=0 leaves those out).
//! Writes JSON lines to $OUT/cuda_bench.jsonl when OUT is set.
#![cfg(feature = "cuda")]

use attnkit::cuda::{CudaBackend, CudaTuning};
use attnkit::{AttentionBackend, AttnCall, DType, HostData, Tensor};
use std::io::Write;

fn data(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) as f32
        })
        .collect()
}

fn rand(be: &CudaBackend, shape: &[usize], dtype: DType, seed: u64) -> Tensor {
    thread_local! {
        // Every prefill shape holds 16k tokens x 2048: build each host tensor once.
        static CACHE: std::cell::RefCell<std::collections::HashMap<(usize, DType, u64), HostData>> = Default::default();
    }
    let n: usize = shape.iter().product();
    let host = CACHE.with(|c| {
        c.borrow_mut()
            .entry((n, dtype, seed))
            .or_insert_with(|| Tensor::from_f32(&[n], dtype, &data(n, seed)).unwrap().host().unwrap().clone())
            .clone()
    });
    be.upload(&Tensor::from_host(shape, host).unwrap()).unwrap()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// Median over 7 event-timed batches of `iters` calls, after 3 warm-up calls.
fn time(be: &CudaBackend, iters: usize, f: &mut dyn FnMut()) -> f64 {
    for _ in 0..3 {
        f();
    }
    be.synchronize().unwrap();
    let v: Vec<f64> = (0..7)
        .map(|_| {
            be.time_ms(iters, || {
                f();
                Ok(())
            })
            .unwrap()
        })
        .collect();
    median(v)
}

fn log(line: String) {
    println!("{line}");
    if let Ok(dir) = std::env::var("OUT") {
        if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(format!("{dir}/cuda_bench.jsonl"))
        {
            let _ = writeln!(f, "{line}");
        }
    }
}

fn rel_err(a: &[f64], b: &[f64]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
    let den: f64 = b.iter().map(|y| y * y).sum();
    (num / den.max(1e-30)).sqrt()
}

/// The backend's tuning with `f` applied (the sweeps below change one knob at a time).
fn tune(be: &mut CudaBackend, f: impl FnOnce(&mut CudaTuning)) {
    let mut t = be.tuning().clone();
    f(&mut t);
    be.set_tuning(t);
}

fn prefill(be: &mut CudaBackend, dtype: DType, d: usize, s: usize, causal: bool, tile: Option<&str>, check: bool) {
    let (b, h) = (16384 / s, 2048 / d);
    let q = rand(be, &[b, s, h, d], dtype, 1);
    let k = rand(be, &[b, s, h, d], dtype, 2);
    let v = rand(be, &[b, s, h, d], dtype, 3);
    let mut out = be.alloc(&[b, s, h, d], dtype).unwrap();
    tune(be, |t| t.tile = tile.and_then(|x| CudaTuning::parse_tile(x, true)));
    let be = &*be;
    let call = AttnCall::dense(&q, &k, &v).causal(causal);
    let t0 = std::time::Instant::now();
    be.forward(&call, Some(&mut out), None).unwrap();
    be.synchronize().unwrap();
    let first_ms = t0.elapsed().as_secs_f64() * 1e3;
    let ms = time(be, 10, &mut || {
        be.forward(&call, Some(&mut out), None).unwrap();
    });
    let flops = 4.0 * (b * h * s * s * d) as f64 / if causal { 2.0 } else { 1.0 };
    let tf = flops / ms / 1e9;
    let mut err = -1.0;
    if check {
        // Against the CUDA-core kernel on the same inputs (the conformance suite checks both
        // against the f64 reference on small shapes).
        let mut be2 = CudaBackend::new().unwrap();
        be2.set_kernel(Some("simt"));
        let mut o2 = be.alloc(&[b, s, h, d], dtype).unwrap();
        be.synchronize().unwrap();
        be2.forward(&AttnCall::dense(&q, &k, &v).causal(causal), Some(&mut o2), None).unwrap();
        be2.synchronize().unwrap();
        let a = be.download(&out).unwrap().to_f64_vec().unwrap();
        let r = be.download(&o2).unwrap().to_f64_vec().unwrap();
        err = rel_err(&a, &r);
        assert!(err < 1e-2, "tensor-core vs CUDA-core relative error {err}");
    }
    let plan = be.plan(&attnkit::validate(&call, be.device(), "cuda", None, None).unwrap());
    log(format!(
        "{{\"kind\":\"prefill\",\"dtype\":\"{dtype}\",\"hdim\":{d},\"seqlen\":{s},\"causal\":{causal},\"tile\":\"{}\",\"plan\":\"{:?}\",\"ms\":{ms:.4},\"tflops\":{tf:.1},\"first_call_ms\":{first_ms:.1},\"rel_err_vs_simt\":{err:.2e}}}",
        tile.unwrap_or("default"),
        plan
    ));
}

fn decode(be: &CudaBackend, b: usize, hq: usize, hkv: usize, sk: usize) {
    let (d, bs, dtype) = (128, 16, DType::BF16);
    let per = sk.div_ceil(bs);
    let nblk = b * per;
    let q = rand(be, &[b, hq, d], dtype, 4);
    let kc = rand(be, &[nblk, bs, hkv, d], dtype, 5);
    let vc = rand(be, &[nblk, bs, hkv, d], dtype, 6);
    // Blocks of each sequence scattered over the cache.
    let table: Vec<i32> = (0..nblk).map(|i| ((i * 7919) % nblk) as i32).collect();
    let cu: Vec<i32> = (0..=b as i32).collect();
    let lens = vec![sk as i32; b];
    let mut out = be.alloc(&[b, hq, d], dtype).unwrap();
    let call = AttnCall::paged(&q, &kc, &vc, &cu, &table, per, &lens);
    be.forward(&call, Some(&mut out), None).unwrap();
    let ms = time(be, 20, &mut || {
        be.forward(&call, Some(&mut out), None).unwrap();
    });
    let bytes = (2 * b * sk * hkv * d * 2) as f64;
    let plan = be.plan(&attnkit::validate(&call, be.device(), "cuda", None, None).unwrap());
    log(format!(
        "{{\"kind\":\"decode\",\"batch\":{b},\"hq\":{hq},\"hkv\":{hkv},\"kv_len\":{sk},\"ms\":{ms:.4},\"gbps\":{:.0},\"plan\":\"{plan:?}\"}}",
        bytes / ms / 1e6
    ));
}

#[test]
#[ignore = "GPU benchmark: run with --ignored on a CUDA machine"]
fn bench_standard_shapes() {
    let mut be = CudaBackend::new().expect("a CUDA device");
    let base = be.tuning().clone();
    let sweep = std::env::var("ATTNKIT_BENCH_SWEEP").map(|v| v == "1").unwrap_or(false);
    println!("device {} ({} SMs)", be.arch(), be.sm_count());
    for d in [64, 128, 256] {
        for causal in [false, true] {
            for s in [2048, 8192] {
                prefill(&mut be, DType::BF16, d, s, causal, None, s == 2048);
            }
        }
    }
    prefill(&mut be, DType::F16, 128, 8192, false, None, false);
    prefill(&mut be, DType::F32, 128, 2048, false, None, false);
    for (b, sk) in [(1, 65536), (16, 4096), (64, 1024), (64, 4096)] {
        decode(&be, b, 32, 32, sk);
    }
    decode(&be, 64, 32, 8, 4096);
    decode(&be, 16, 32, 8, 4096);
    decode(&be, 1, 32, 8, 65536);
    // ATTNKIT_BENCH_DECODE_SWEEP=0 leaves the decode part of the sweep out.
    let decode_sweep = std::env::var("ATTNKIT_BENCH_DECODE_SWEEP").map(|v| v != "0").unwrap_or(true);
    if sweep && decode_sweep {
        for (name, set) in [
            ("GQA decode on CUDA cores", CudaTuning { gqa_mma: false, ..base.clone() }),
            ("GQA decode tile of 16 keys", CudaTuning { gqa_bn: Some(16), ..base.clone() }),
            ("GQA decode tile of 64 keys", CudaTuning { gqa_bn: Some(64), ..base.clone() }),
        ] {
            be.set_tuning(set);
            println!("{name}");
            decode(&be, 64, 32, 8, 4096);
            decode(&be, 16, 32, 8, 4096);
            decode(&be, 1, 32, 8, 65536);
        }
        for mult in [2, 4, 8, 16] {
            be.set_tuning(CudaTuning { split_target: Some(mult), ..base.clone() });
            println!("split target {mult} x SMs");
            decode(&be, 1, 32, 32, 65536);
            decode(&be, 16, 32, 32, 4096);
            decode(&be, 64, 32, 8, 4096);
            decode(&be, 16, 32, 8, 4096);
            decode(&be, 1, 32, 8, 65536);
        }
        be.set_tuning(base.clone());
    }
    // ATTNKIT_BENCH_GQA_TILES="BM,BN,NW,MINB,WG;..." times GQA decode with other tiles (and
    // ATTNKIT_BENCH_SPLITS="2,4,8" with other split targets).
    if let Ok(list) = std::env::var("ATTNKIT_BENCH_GQA_TILES") {
        let splits = std::env::var("ATTNKIT_BENCH_SPLITS").unwrap_or_else(|_| "8".into());
        for tile in list.split(';').filter(|t| !t.is_empty()) {
            for mult in splits.split(',') {
                be.set_tuning(CudaTuning {
                    gqa_tile: CudaTuning::parse_tile(tile, false),
                    split_target: mult.parse().ok(),
                    ..base.clone()
                });
                println!("GQA tile {tile}, split target {mult} x SMs");
                decode(&be, 64, 32, 8, 4096);
                decode(&be, 16, 32, 8, 4096);
                decode(&be, 1, 32, 8, 65536);
            }
        }
        be.set_tuning(base.clone());
    }
    // ATTNKIT_BENCH_GQA_BULK="off:32;2:32;3:16" times GQA decode with each bulk-copy setting
    // (stages, or off) and key count per tile, at the split targets of ATTNKIT_BENCH_SPLITS (CTAs
    // per SM, or "wave").
    if let Ok(list) = std::env::var("ATTNKIT_BENCH_GQA_BULK") {
        let splits = std::env::var("ATTNKIT_BENCH_SPLITS").unwrap_or_else(|_| "8".into());
        for item in list.split(';').filter(|t| !t.is_empty()) {
            let (bulk, bn) = item.split_once(':').unwrap_or((item, "32"));
            for mult in splits.split(',') {
                // "wave" (or anything but a count): the planner's own split count (whole waves of
                // resident CTAs).
                be.set_tuning(CudaTuning {
                    gqa_bulk: Some(if bulk == "off" { 0 } else { bulk.parse().unwrap_or(2) }),
                    gqa_bn: bn.parse().ok(),
                    split_target: mult.parse().ok(),
                    ..base.clone()
                });
                println!("GQA bulk {bulk}, {bn} keys a tile, split target {mult}");
                decode(&be, 64, 32, 8, 4096);
                decode(&be, 16, 32, 8, 4096);
                decode(&be, 1, 32, 8, 65536);
            }
        }
        be.set_tuning(base.clone());
    }
    if sweep {
        // BM,BN,NW,MINB,WG: rows per CTA, keys per tile, warps, CTAs per SM the registers must
        // fit, and 1 for Hopper's warpgroup MMAs (0: mma.sync). ATTNKIT_BENCH_TILES=0 leaves
        // this part out.
        let tiles_on = std::env::var("ATTNKIT_BENCH_TILES").map(|v| v != "0").unwrap_or(true);
        for (d, tiles) in [
            (
                128,
                &[
                    "128,64,4,1,0",
                    "128,64,8,1,1",
                    "128,128,8,1,1",
                    "64,64,4,2,1",
                    "64,128,4,1,1",
                    "192,64,12,1,1",
                    "128,64,8,2,1",
                ][..],
            ),
            (64, &["128,64,4,1,0", "128,64,8,1,1", "128,128,8,1,1", "64,64,4,2,1", "64,128,4,2,1", "128,64,8,2,1"][..]),
            (256, &["128,64,8,1,0", "128,64,8,1,1", "64,64,4,1,1", "64,64,4,2,1"][..]),
        ] {
            for t in tiles.iter().filter(|_| tiles_on) {
                for causal in [false, true] {
                    prefill(&mut be, DType::BF16, d, 8192, causal, Some(t), false);
                }
            }
        }
    }
    for k in be.loaded_kernels() {
        log(format!(
            "{{\"kind\":\"kernel\",\"key\":\"{}\",\"regs\":{},\"local_bytes\":{},\"static_smem\":{},\"ctas_per_sm\":{},\"cached\":{},\"load_ms\":{:.1}}}",
            k.key, k.regs, k.local_bytes, k.static_smem, k.ctas_per_sm, k.cached, k.load_ms
        ));
    }
    // A second backend in this process loads every kernel from the disk cache: the warm start.
    let t0 = std::time::Instant::now();
    let be2 = CudaBackend::new().unwrap();
    let q = rand(&be2, &[1, 128, 16, 128], DType::BF16, 9);
    let call = AttnCall::dense(&q, &q, &q).causal(true);
    be2.forward(&call, None, None).unwrap();
    be2.synchronize().unwrap();
    let kernels: Vec<String> = be2
        .loaded_kernels()
        .iter()
        .map(|k| format!("{{\"key\":\"{}\",\"cached\":{},\"load_ms\":{:.2}}}", k.key, k.cached, k.load_ms))
        .collect();
    log(format!(
        "{{\"kind\":\"warm_start\",\"ms\":{:.1},\"kernels\":[{}]}}",
        t0.elapsed().as_secs_f64() * 1e3,
        kernels.join(",")
    ));
}
