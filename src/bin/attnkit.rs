//! The `attnkit` command: `info`, `run`, `bench`, `check`.

#[path = "attnkit/bench.rs"]
mod bench;
#[path = "attnkit/check.rs"]
mod check;
#[path = "attnkit/gen.rs"]
mod gen;

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::ExitCode;

use attnkit::casefile::{self, Case};
use attnkit::{AttentionBackend, DType, Device};
use clap::{Parser, Subcommand, ValueEnum};

#[derive(Parser)]
#[command(
    name = "attnkit",
    version,
    about = "One attention contract, many kernels: inspect, run, benchmark and cross-check the backends of this build"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Backends compiled in, the devices they found, and what each supports.
    Info,
    /// Run one case file on one backend and write `out` and `lse` as safetensors.
    Run {
        /// `reference`, `cpu`, `wgpu`, `cuda`, or `best` (the fastest present that supports the case).
        #[arg(long, short, default_value = "best")]
        backend: String,
        /// The case file (safetensors: q, k, v, ... with string metadata layout, causal, ...).
        case: PathBuf,
        /// Where to write the result.
        #[arg(long, short)]
        output: PathBuf,
    },
    /// Time standard shapes on each backend present: median of timed runs after warm-up.
    Bench {
        /// Backends to time, comma-separated (`best` allowed); default: every one present but `reference`.
        #[arg(long, short, value_delimiter = ',')]
        backend: Vec<String>,
        /// Input dtype.
        #[arg(long, default_value = "bf16", value_parser = parse_dtype)]
        dtype: DType,
        /// Causal prefill: `true`, `false` or `both` (decode has one query per sequence and runs once).
        #[arg(long, value_enum, default_value = "both")]
        causal: Causal,
        /// Shapes, comma-separated: standard names (see --list), `all`, `prefill:B,H,S,D` or
        /// `decode:B,HQ,HKV,SK,D`; default: all on GPUs, the small ones on the host.
        #[arg(long)]
        shapes: Option<String>,
        /// List the standard shapes and exit.
        #[arg(long)]
        list: bool,
        /// Timed runs per shape (at most).
        #[arg(long, default_value_t = 20)]
        iters: usize,
        /// Untimed runs before timing.
        #[arg(long, default_value_t = 2)]
        warmup: usize,
        /// Fewer timed runs (never under 3) when they would take longer than this.
        #[arg(long, default_value_t = 10.0)]
        max_seconds: f64,
        /// Print JSON instead of the table.
        #[arg(long)]
        json: bool,
    },
    /// Random problems on every backend present, each against the f64 reference and against each other.
    Check {
        /// Backends to check, comma-separated; default: every one present.
        #[arg(long, short, value_delimiter = ',')]
        backend: Vec<String>,
        /// Random cases.
        #[arg(long, default_value_t = 200)]
        cases: usize,
        /// Seed (printed, so a failure can be replayed).
        #[arg(long)]
        seed: Option<u64>,
        /// Print every case.
        #[arg(long, short)]
        verbose: bool,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum Causal {
    True,
    False,
    Both,
}

fn parse_dtype(s: &str) -> Result<DType, String> {
    match DType::parse(s) {
        Some(DType::I32) | None => Err(format!("`{s}` is not f32, f16 or bf16")),
        Some(d) => Ok(d),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::Info => info(),
        Cmd::Run { backend, case, output } => run(&backend, &case, &output),
        Cmd::Bench { backend, dtype, causal, shapes, list, iters, warmup, max_seconds, json } => {
            if list {
                for (n, s, host) in bench::STANDARD.iter() {
                    println!(
                        "{n:<12} {:<7} {:<32} {}",
                        if s.is_decode() { "decode" } else { "prefill" },
                        s.describe(),
                        if *host { "(default on host too)" } else { "" }
                    );
                }
                return ExitCode::SUCCESS;
            }
            let causal = match causal {
                Causal::True => vec![true],
                Causal::False => vec![false],
                Causal::Both => vec![false, true],
            };
            let o = bench::Opts { iters, warmup, max_seconds };
            bench_cmd(&backend, dtype, &causal, shapes.as_deref(), &o, json)
        }
        Cmd::Check { backend, cases, seed, verbose } => check_cmd(&backend, cases, seed, verbose),
    };
    match r {
        Ok(code) => code,
        Err(e) => {
            eprintln!("attnkit: error: {e}");
            ExitCode::FAILURE
        }
    }
}

type Res = Result<ExitCode, String>;

fn info() -> Res {
    println!("attnkit {}: backends compiled in: {}", env!("CARGO_PKG_VERSION"), attnkit::compiled().join(", "));
    println!(
        "{:<10} {:<9} {:<14} {:<28} {:<20} masks and options",
        "backend", "device", "dtypes", "head dims", "layouts"
    );
    for name in attnkit::BACKENDS {
        match attnkit::by_name(name) {
            Ok(b) => {
                let c = b.capabilities();
                let dt: Vec<&str> = c.dtypes.iter().map(|d| d.name()).collect();
                let ly: Vec<&str> = c.layouts.iter().map(|l| l.name()).collect();
                let mut f = Vec::new();
                for (on, what) in [
                    (c.causal, "causal"),
                    (c.window, "window"),
                    (c.softcap, "softcap"),
                    (c.alibi, "alibi"),
                    (c.lse, "lse"),
                ] {
                    f.push(if on { what.to_string() } else { format!("no {what}") });
                }
                println!(
                    "{:<10} {:<9} {:<14} {:<28} {:<20} {}",
                    name,
                    b.device().to_string(),
                    dt.join(","),
                    match c.head_dims {
                        attnkit::HeadDims::UpTo(usize::MAX) => "any".to_string(),
                        h => h.to_string(),
                    },
                    ly.join(","),
                    f.join(", ")
                );
            }
            Err(e) => println!("{name:<10} -         {e}"),
        }
    }
    println!("host threads (rayon): {}", rayon::current_num_threads());
    devices();
    Ok(ExitCode::SUCCESS)
}

/// What each compiled-in backend found, in the driver's words.
fn devices() {
    #[cfg(feature = "cpu")]
    println!("cpu: {} kernels", attnkit::cpu::CpuBackend::isa());
    #[cfg(feature = "wgpu")]
    if let Ok(w) = attnkit::wgpu::WgpuBackend::new() {
        println!("wgpu: adapter {}", w.adapter_name());
    }
    #[cfg(feature = "cuda")]
    {
        if let Ok(c) = attnkit::cuda::CudaBackend::new() {
            println!("cuda: device 0, {} with {} SMs", c.arch(), c.sm_count());
        }
        match attnkit::cuda::nvrtc_version() {
            Ok((major, minor)) => println!("cuda: NVRTC {major}.{minor}"),
            Err(e) => println!("cuda: NVRTC not loadable: {e}"),
        }
    }
}

/// A backend by name, or the best present for `problem` with why it skipped the others.
fn pick(name: &str, problem: Option<&attnkit::Problem>) -> Result<Box<dyn AttentionBackend>, String> {
    if name == "best" {
        let s = attnkit::best(problem).map_err(|e| e.to_string())?;
        for (n, why) in &s.skipped {
            eprintln!("attnkit: skipped {n}: {why}");
        }
        eprintln!("attnkit: using backend {} on {}", s.backend.name(), s.backend.device());
        return Ok(s.backend);
    }
    attnkit::by_name(name).map_err(|e| e.to_string())
}

fn run(backend: &str, path: &PathBuf, output: &PathBuf) -> Res {
    let case = Case::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let host_call = case.call();
    let problem = attnkit::validate(&host_call, Device::Host, "casefile", None, None)
        .map_err(|e| format!("{}: {e}", path.display()))?
        .problem(true);
    let be = pick(backend, Some(&problem))?;
    let e = |e: attnkit::Error| format!("{} on backend {}: {e}", path.display(), be.name());
    let (q, k, v) = (be.upload(&case.q).map_err(e)?, be.upload(&case.k).map_err(e)?, be.upload(&case.v).map_err(e)?);
    let call = case.call_on(&q, &k, &v);
    let mut out = be.alloc(q.shape(), q.dtype()).map_err(e)?;
    let mut lse = be.alloc(&case.lse_shape(), DType::F32).map_err(e)?;
    let t = std::time::Instant::now();
    be.forward(&call, Some(&mut out), Some(&mut lse)).map_err(e)?;
    be.synchronize().map_err(e)?;
    let secs = t.elapsed().as_secs_f64();
    let (out, lse) = (be.download(&out).map_err(e)?, be.download(&lse).map_err(e)?);
    let md: HashMap<String, String> = [("backend".to_string(), be.name().to_string())].into();
    casefile::write_result(output, &out, &lse, Some(md)).map_err(|e| e.to_string())?;
    eprintln!(
        "attnkit: {} -> {}: out {:?} {}, lse {:?} f32 on {} in {:.3} ms",
        path.display(),
        output.display(),
        out.shape(),
        out.dtype(),
        lse.shape(),
        be.name(),
        secs * 1e3
    );
    Ok(ExitCode::SUCCESS)
}

/// The named backends, or every one present (but `reference` unless `with_reference`). A named
/// backend that cannot start is an error; an unnamed one is reported and left out.
fn backends(names: &[String], with_reference: bool) -> Result<Vec<Box<dyn AttentionBackend>>, String> {
    let mut v = Vec::new();
    if names.is_empty() {
        for n in attnkit::BACKENDS {
            if n == "reference" && !with_reference {
                continue;
            }
            match attnkit::by_name(n) {
                Ok(b) => v.push(b),
                Err(attnkit::Error::NotCompiled { .. }) => {}
                Err(e) => eprintln!("attnkit: leaving out {n}: {e}"),
            }
        }
    } else {
        for n in names {
            v.push(pick(n.trim(), None)?);
        }
    }
    if v.is_empty() {
        return Err("no backend to run".into());
    }
    Ok(v)
}

fn bench_cmd(
    names: &[String],
    dtype: DType,
    causal: &[bool],
    shapes: Option<&str>,
    o: &bench::Opts,
    json: bool,
) -> Res {
    let selected = shapes.map(bench::parse_shapes).transpose()?;
    let bes = backends(names, false)?;
    #[cfg(feature = "cpu")]
    let peak = if bes.iter().any(|b| b.name() == "cpu") { Some(attnkit::cpu::fma_peak_gflops()) } else { None };
    #[cfg(not(feature = "cpu"))]
    let peak: Option<(f64, &str)> = None;
    // Every shape once, in order; inputs built once per shape and shared by the backends.
    let per_backend: Vec<Vec<(String, bench::Shape)>> =
        bes.iter().map(|b| bench::shapes_for(&selected, b.device() == Device::Host)).collect();
    let mut plan: Vec<(String, bench::Shape)> = Vec::new();
    for s in per_backend.iter().flatten() {
        if !plan.iter().any(|p| p.0 == s.0) {
            plan.push(s.clone());
        }
    }
    let mut rows = Vec::new();
    for (sname, shape) in &plan {
        let inp = bench::Inputs::new(shape, dtype, 42);
        let cs: &[bool] = if shape.is_decode() { &causal[..1] } else { causal };
        for &c in cs {
            for (be, mine) in bes.iter().zip(&per_backend) {
                if !mine.iter().any(|s| &s.0 == sname) {
                    continue;
                }
                let mut row = bench::Row {
                    backend: be.name().to_string(),
                    device: be.device().to_string(),
                    shape: sname.clone(),
                    dims: shape.describe(),
                    decode: shape.is_decode(),
                    dtype,
                    causal: c,
                    runs: 0,
                    median_s: f64::NAN,
                    min_s: f64::NAN,
                    flops: shape.flops(c),
                    kv_bytes: shape.kv_bytes(dtype),
                    peak_fraction: None,
                    note: None,
                };
                if let Err(why) = bench::head_dim_ok(be.as_ref(), shape, dtype, c) {
                    row.note = Some(why);
                    rows.push(row);
                    continue;
                }
                if !json {
                    eprintln!(
                        "attnkit bench: {} {sname} ({}) {dtype}{}",
                        be.name(),
                        shape.describe(),
                        if c { " causal" } else { "" }
                    );
                }
                match bench::measure(be.as_ref(), be.name(), shape, dtype, c, &inp, o) {
                    Ok((n, med, min)) => {
                        row.runs = n;
                        row.median_s = med;
                        row.min_s = min;
                    }
                    Err(e) => row.note = Some(e),
                }
                rows.push(row);
            }
        }
    }
    // The peak again after the runs, keeping the higher: on a shared machine either may be low.
    #[cfg(feature = "cpu")]
    let peak = peak.map(|(g, isa)| (g.max(attnkit::cpu::fma_peak_gflops().0), isa));
    for r in rows.iter_mut().filter(|r| r.backend == "cpu" && r.note.is_none()) {
        r.peak_fraction = peak.map(|(g, _)| r.flops / r.median_s / 1e9 / g);
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&bench::json(&rows, peak)).map_err(|e| e.to_string())?);
    } else {
        bench::print_table(&rows, peak);
    }
    Ok(ExitCode::SUCCESS)
}

fn check_cmd(names: &[String], cases: usize, seed: Option<u64>, verbose: bool) -> Res {
    let bes = backends(names, false)?;
    let seed = seed.unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(1)
    });
    Ok(if check::check(&bes, cases, seed, verbose) { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}
