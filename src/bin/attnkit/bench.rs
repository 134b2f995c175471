//! `attnkit bench`: standard shapes on each backend, median of timed runs after warm-up.

use std::time::Instant;

use attnkit::{AttentionBackend, AttnCall, DType, Device, LayoutKind, Params, Tensor};

use crate::gen::{prefix, tensor, Rng};

/// One benchmark shape.
#[derive(Clone, Debug, PartialEq)]
pub enum Shape {
    /// Dense self-attention: q, k, v `[B, S, H, D]`.
    Prefill { b: usize, h: usize, s: usize, d: usize },
    /// One new token per sequence over a paged cache of `sk` tokens (block size 16).
    Decode { b: usize, hq: usize, hkv: usize, sk: usize, d: usize },
}

/// The standard shapes: name, shape, and whether host backends run it by default (the large ones
/// take minutes on a few cores).
pub const STANDARD: [(&str, Shape, bool); 7] = [
    ("prefill-1k", Shape::Prefill { b: 1, h: 16, s: 1024, d: 64 }, true),
    ("prefill-2k", Shape::Prefill { b: 1, h: 16, s: 2048, d: 128 }, false),
    ("prefill-4k", Shape::Prefill { b: 4, h: 32, s: 4096, d: 128 }, false),
    ("prefill-8k", Shape::Prefill { b: 1, h: 32, s: 8192, d: 128 }, false),
    ("decode-4k", Shape::Decode { b: 8, hq: 32, hkv: 8, sk: 4096, d: 128 }, true),
    ("decode-32k", Shape::Decode { b: 16, hq: 32, hkv: 8, sk: 32768, d: 128 }, false),
    ("decode-b64", Shape::Decode { b: 64, hq: 32, hkv: 8, sk: 2048, d: 128 }, false),
];

impl Shape {
    /// `prefill:B,H,S,D` or `decode:B,HQ,HKV,SK,D`.
    pub fn parse(s: &str) -> Result<Shape, String> {
        let (kind, dims) = s.split_once(':').ok_or_else(|| format!("unknown shape `{s}`"))?;
        let n: Vec<usize> = dims
            .split(',')
            .map(|x| x.trim().parse::<usize>().map_err(|_| format!("shape `{s}`: `{x}` is not a number")))
            .collect::<Result<_, _>>()?;
        if n.contains(&0) {
            return Err(format!("shape `{s}`: every size must be >= 1"));
        }
        match (kind, n.as_slice()) {
            ("prefill", &[b, h, s, d]) => Ok(Shape::Prefill { b, h, s, d }),
            ("decode", &[b, hq, hkv, sk, d]) if hq % hkv == 0 => Ok(Shape::Decode { b, hq, hkv, sk, d }),
            ("decode", &[_, hq, hkv, _, _]) => Err(format!("shape `{s}`: HQ = {hq} is not a multiple of HKV = {hkv}")),
            _ => Err(format!("shape `{s}`: expected prefill:B,H,S,D or decode:B,HQ,HKV,SK,D")),
        }
    }

    pub fn describe(&self) -> String {
        match *self {
            Shape::Prefill { b, h, s, d } => format!("B={b} H={h} S={s} D={d}"),
            Shape::Decode { b, hq, hkv, sk, d } => format!("B={b} Hq={hq} Hkv={hkv} Sk={sk} D={d}"),
        }
    }

    fn head_dim(&self) -> usize {
        match *self {
            Shape::Prefill { d, .. } | Shape::Decode { d, .. } => d,
        }
    }

    /// FLOPs of the two matmuls over the visible (query, key) pairs: 4 * D per pair and head.
    pub fn flops(&self, causal: bool) -> f64 {
        match *self {
            Shape::Prefill { b, h, s, d } => {
                let p = Params { causal, ..Params::default() };
                let pairs: usize = (0..s)
                    .map(|i| {
                        let (lo, hi) = attnkit::key_range(i, s, s, &p);
                        hi - lo
                    })
                    .sum();
                4.0 * (b * h * d) as f64 * pairs as f64
            }
            Shape::Decode { b, hq, sk, d, .. } => 4.0 * (b * hq * d * sk) as f64,
        }
    }

    /// Bytes of K and V read once (the floor of a decode step).
    pub fn kv_bytes(&self, dtype: DType) -> f64 {
        match *self {
            Shape::Prefill { b, h, s, d } => 2.0 * (b * s * h * d * dtype.size()) as f64,
            Shape::Decode { b, hkv, sk, d, .. } => 2.0 * (b * sk * hkv * d * dtype.size()) as f64,
        }
    }

    pub fn is_decode(&self) -> bool {
        matches!(self, Shape::Decode { .. })
    }
}

/// Host inputs of a shape.
pub struct Inputs {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_q: Vec<i32>,
    table: Vec<i32>,
    max_blocks: usize,
    seq_lens: Vec<i32>,
}

pub const BLOCK: usize = 16;

impl Inputs {
    pub fn new(shape: &Shape, dtype: DType, seed: u64) -> Inputs {
        let mut rng = Rng::new(seed);
        match *shape {
            Shape::Prefill { b, h, s, d } => Inputs {
                q: tensor(&mut rng, &[b, s, h, d], dtype, 1.5),
                k: tensor(&mut rng, &[b, s, h, d], dtype, 1.5),
                v: tensor(&mut rng, &[b, s, h, d], dtype, 1.0),
                cu_q: vec![],
                table: vec![],
                max_blocks: 0,
                seq_lens: vec![],
            },
            Shape::Decode { b, hq, hkv, sk, d } => {
                let max_blocks = sk.div_ceil(BLOCK);
                let nb = b * max_blocks;
                // A shuffled table, as a cache allocator leaves it after a while.
                let mut table: Vec<i32> = (0..nb as i32).collect();
                for i in (1..nb).rev() {
                    table.swap(i, rng.below(i + 1));
                }
                Inputs {
                    q: tensor(&mut rng, &[b, hq, d], dtype, 1.5),
                    k: tensor(&mut rng, &[nb, BLOCK, hkv, d], dtype, 1.5),
                    v: tensor(&mut rng, &[nb, BLOCK, hkv, d], dtype, 1.0),
                    cu_q: prefix(std::iter::repeat_n(1, b)),
                    table,
                    max_blocks,
                    seq_lens: vec![sk as i32; b],
                }
            }
        }
    }
}

/// One measured (backend, shape) pair.
#[derive(Clone, Debug)]
pub struct Row {
    pub backend: String,
    pub device: String,
    pub shape: String,
    pub dims: String,
    pub decode: bool,
    pub dtype: DType,
    pub causal: bool,
    pub runs: usize,
    pub median_s: f64,
    pub min_s: f64,
    pub flops: f64,
    pub kv_bytes: f64,
    /// Fraction of the measured FMA peak (cpu only).
    pub peak_fraction: Option<f64>,
    pub note: Option<String>,
}

impl Row {
    pub fn tflops(&self) -> f64 {
        self.flops / self.median_s / 1e12
    }
    pub fn gbps(&self) -> f64 {
        self.kv_bytes / self.median_s / 1e9
    }
}

pub struct Opts {
    pub iters: usize,
    pub warmup: usize,
    pub max_seconds: f64,
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Time one shape on one backend: warm-up, then the median of up to `iters` samples (at least 3,
/// fewer than `iters` when they would take longer than `max_seconds`). The device is synchronised
/// before every clock stop; the output is checked to be finite and not all zero.
pub fn measure(
    be: &dyn AttentionBackend,
    name: &str,
    shape: &Shape,
    dtype: DType,
    causal: bool,
    inp: &Inputs,
    o: &Opts,
) -> Result<(usize, f64, f64), String> {
    let e = |e: attnkit::Error| e.to_string();
    let (q, k, v) = (be.upload(&inp.q).map_err(e)?, be.upload(&inp.k).map_err(e)?, be.upload(&inp.v).map_err(e)?);
    let call = if shape.is_decode() {
        AttnCall::paged(&q, &k, &v, &inp.cu_q, &inp.table, inp.max_blocks, &inp.seq_lens)
    } else {
        AttnCall::dense(&q, &k, &v)
    }
    .causal(causal);
    let mut out = be.alloc(q.shape(), dtype).map_err(e)?;
    // One sample: `inner` calls back to back, then one synchronisation, divided by `inner`; so a
    // short GPU call is not charged the host's launch-and-wait round trip (inner is 1 for calls
    // of 10 ms or more, and on the host). Samples of about 10 ms: with 1 ms ones, a 0.3 ms decode
    // call on an H200 read 8% slower than the same calls timed with CUDA events.
    let run = |out: &mut Tensor, inner: usize| -> Result<f64, String> {
        let t = Instant::now();
        for _ in 0..inner {
            be.forward(&call, Some(out), None).map_err(e)?;
        }
        be.synchronize().map_err(e)?;
        Ok(t.elapsed().as_secs_f64() / inner as f64)
    };
    let mut first = f64::MAX;
    for _ in 0..o.warmup.max(1) {
        first = first.min(run(&mut out, 1)?);
    }
    let host = be.download(&out).map_err(e)?.to_f64_vec().map_err(e)?;
    if host.iter().any(|x| !x.is_finite()) || host.iter().all(|&x| x == 0.0) {
        return Err(format!("{name}: the output is not finite or all zero; not timing it"));
    }
    let inner = if be.device() == Device::Host { 1 } else { ((1e-2 / first.max(1e-9)) as usize).clamp(1, 256) };
    if inner > 1 {
        run(&mut out, inner)?;
    }
    let n = ((o.max_seconds / (first * inner as f64).max(1e-9)) as usize).clamp(3, o.iters.max(3));
    let mut times = Vec::with_capacity(n);
    for _ in 0..n {
        times.push(run(&mut out, inner)?);
    }
    let min = times.iter().copied().fold(f64::MAX, f64::min);
    Ok((n, median(&mut times), min))
}

/// Which shapes a backend runs: the ones asked for, or the defaults for its device.
pub fn shapes_for(selected: &Option<Vec<(String, Shape)>>, host: bool) -> Vec<(String, Shape)> {
    match selected {
        Some(s) => s.clone(),
        None => STANDARD
            .iter()
            .filter(|(_, _, on_host)| !host || *on_host)
            .map(|(n, s, _)| (n.to_string(), s.clone()))
            .collect(),
    }
}

/// Parse `--shapes`: standard names, `all`, or `prefill:B,H,S,D` / `decode:B,HQ,HKV,SK,D`.
pub fn parse_shapes(list: &str) -> Result<Vec<(String, Shape)>, String> {
    let mut v = Vec::new();
    for item in list.split(';').flat_map(split_names) {
        if item == "all" {
            v.extend(STANDARD.iter().map(|(n, s, _)| (n.to_string(), s.clone())));
        } else if let Some((n, s, _)) = STANDARD.iter().find(|(n, _, _)| *n == item) {
            v.push((n.to_string(), s.clone()));
        } else {
            v.push((item.clone(), Shape::parse(&item)?));
        }
    }
    if v.is_empty() {
        return Err("--shapes is empty".into());
    }
    Ok(v)
}

/// Split `a,b,prefill:1,2,3,4,c` into items: a custom shape keeps its commas.
fn split_names(s: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for part in s.split(',') {
        let part = part.trim();
        if part.is_empty() {
            continue;
        }
        match out.last_mut() {
            Some(last) if last.contains(':') && !part.contains(':') && !is_name(part) => {
                last.push(',');
                last.push_str(part);
            }
            _ => out.push(part.to_string()),
        }
    }
    out
}

fn is_name(s: &str) -> bool {
    s == "all" || STANDARD.iter().any(|(n, _, _)| *n == s)
}

pub fn head_dim_ok(be: &dyn AttentionBackend, shape: &Shape, dtype: DType, causal: bool) -> Result<(), String> {
    let mut p = attnkit::Problem::new(dtype, shape.head_dim());
    p.causal = causal;
    if let Shape::Decode { hq, hkv, .. } = *shape {
        p.layout = LayoutKind::Paged;
        p.num_heads_q = hq;
        p.num_heads_kv = hkv;
    }
    be.supports(&p).map_err(|u| u.reasons.join("; "))
}

/// A figure with about four significant digits.
fn sig(x: f64) -> String {
    if x >= 100.0 {
        format!("{x:.0}")
    } else if x >= 1.0 {
        format!("{x:.2}")
    } else {
        format!("{x:.4}")
    }
}

/// The table, with each backend's time as a multiple of cpu's on the same shape when cpu ran.
pub fn print_table(rows: &[Row], peak: Option<(f64, &str)>) {
    println!(
        "{:<10} {:<10} {:<18} {:<40} {:>5} {:>10} {:>10} {:>10} {:>9} {:>8} {:>8}",
        "backend", "device", "shape", "dims", "runs", "median ms", "min ms", "TFLOP/s", "GB/s K/V", "x cpu", "% peak"
    );
    for r in rows {
        if let Some(n) = &r.note {
            println!(
                "{:<10} {:<10} {:<18} {:<40} skipped: {n}",
                r.backend,
                r.device,
                r.shape,
                format!("{} {}{}", r.dims, r.dtype, if r.causal { " causal" } else { "" })
            );
            continue;
        }
        let cpu =
            rows.iter().find(|c| c.backend == "cpu" && c.note.is_none() && c.shape == r.shape && c.causal == r.causal);
        let vs = match cpu {
            Some(c) if r.backend != "cpu" => format!("{:.2}x", c.median_s / r.median_s),
            _ => "-".into(),
        };
        let gb = if r.decode { sig(r.gbps()) } else { "-".into() };
        let pk = r.peak_fraction.map(|f| format!("{:.1}%", f * 100.0)).unwrap_or_else(|| "-".into());
        println!(
            "{:<10} {:<10} {:<18} {:<40} {:>5} {:>10.3} {:>10.3} {:>10} {:>9} {:>8} {:>8}",
            r.backend,
            r.device,
            r.shape,
            format!("{} {}{}", r.dims, r.dtype, if r.causal { " causal" } else { "" }),
            r.runs,
            r.median_s * 1e3,
            r.min_s * 1e3,
            sig(r.tflops()),
            gb,
            vs,
            pk
        );
    }
    if let Some((g, isa)) = peak {
        println!(
            "cpu: measured f32 FMA peak {g:.1} GFLOP/s ({isa}, {} threads, the higher of before and after the runs); % peak = achieved FLOP/s / that peak",
            rayon::current_num_threads()
        );
    }
    println!("TFLOP/s counts 4*D FLOPs per visible (query, key) pair and head; GB/s counts K and V read once.");
}

pub fn json(rows: &[Row], peak: Option<(f64, &str)>) -> serde_json::Value {
    let rows: Vec<serde_json::Value> = rows
        .iter()
        .map(|r| {
            let mut o = serde_json::json!({
                "backend": r.backend, "device": r.device, "shape": r.shape, "dims": r.dims,
                "kind": if r.decode { "decode" } else { "prefill" },
                "dtype": r.dtype.name(), "causal": r.causal,
            });
            if let Some(n) = &r.note {
                o["skipped"] = n.clone().into();
            } else {
                o["runs"] = r.runs.into();
                o["median_ms"] = (r.median_s * 1e3).into();
                o["min_ms"] = (r.min_s * 1e3).into();
                o["flops"] = r.flops.into();
                o["tflops"] = r.tflops().into();
                o["kv_bytes"] = r.kv_bytes.into();
                o["kv_gbps"] = r.gbps().into();
                if let Some(f) = r.peak_fraction {
                    o["fma_peak_fraction"] = f.into();
                }
            }
            o
        })
        .collect();
    serde_json::json!({
        "threads": rayon::current_num_threads(),
        "cpu_fma_peak_gflops": peak.map(|p| p.0),
        "cpu_fma_isa": peak.map(|p| p.1),
        "rows": rows,
    })
}
