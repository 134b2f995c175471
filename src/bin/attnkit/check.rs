//! `attnkit check`: random problems on every backend present, each compared with the f64
//! reference and with every other backend; a table; failure when anything disagrees.

use attnkit::{AttentionBackend, DType, Device, HostData, Tensor};

use crate::gen::{Rng, Spec};

/// The SPEC's tolerances: (atol, rtol) for `out` of each dtype.
pub fn tol(dtype: DType) -> (f64, f64) {
    match dtype {
        DType::F32 => (2e-5, 1e-4),
        DType::F16 => (2e-3, 5e-3),
        DType::BF16 => (1.6e-2, 2e-2),
        DType::I32 => (0.0, 0.0),
    }
}

/// Head dims drawn; each backend runs those it declares.
const DIMS: [usize; 13] = [1, 3, 8, 16, 32, 40, 64, 80, 96, 128, 160, 192, 256];

/// Worst `|got - want| / (atol + rtol |want|)` and where, `Err` on NaN where the reference is
/// finite or a mismatch in infinities.
fn worst(got: &[f64], want: &[f64], atol: f64, rtol: f64) -> Result<(f64, usize), String> {
    if got.len() != want.len() {
        return Err(format!("length {} != {}", got.len(), want.len()));
    }
    let mut w = (0.0f64, 0usize);
    for (i, (&g, &r)) in got.iter().zip(want).enumerate() {
        if r.is_infinite() || g.is_infinite() || g.is_nan() {
            if g != r {
                return Err(format!("[{i}]: got {g}, want {r}"));
            }
            continue;
        }
        let e = (g - r).abs() / (atol + rtol * r.abs());
        if e > w.0 {
            w = (e, i);
        }
    }
    Ok(w)
}

#[derive(Default)]
struct Tally {
    cases: usize,
    passed: usize,
    failed: usize,
    unsupported: usize,
    worst: f64,
    first_failure: Option<String>,
}

impl Tally {
    fn fail(&mut self, msg: String) {
        self.failed += 1;
        if self.first_failure.is_none() {
            self.first_failure = Some(msg);
        }
    }
}

struct Got {
    out: Vec<f64>,
    lse: Vec<f64>,
}

/// Run on a backend twice: allocating, and into a sentinel-filled buffer; both must agree bit for bit.
fn run(be: &dyn AttentionBackend, case: &attnkit::casefile::Case) -> Result<Got, String> {
    let e = |e: attnkit::Error| e.to_string();
    let (q, k, v) = (be.upload(&case.q).map_err(e)?, be.upload(&case.k).map_err(e)?, be.upload(&case.v).map_err(e)?);
    let call = case.call_on(&q, &k, &v).with_lse(true);
    let o = be.forward(&call, None, None).map_err(e)?;
    let (out, lse) = (o.out.ok_or("forward returned no out")?, o.lse.ok_or("forward returned no lse")?);
    be.synchronize().map_err(e)?;
    let out_h = be.download(&out).map_err(e)?;
    let lse_h = be.download(&lse).map_err(e)?;
    // The same call into caller buffers that hold a sentinel.
    let n = case.q.elem_count();
    let sentinel = Tensor::from_f64(case.q.shape(), case.q.dtype(), &vec![-12345.0; n]).map_err(e)?;
    let mut buf = be.upload(&sentinel).map_err(e)?;
    let mut lbuf = be
        .upload(&Tensor::from_f64(lse_h.shape(), DType::F32, &vec![7.0; lse_h.elem_count()]).map_err(e)?)
        .map_err(e)?;
    be.forward(&case.call_on(&q, &k, &v), Some(&mut buf), Some(&mut lbuf)).map_err(e)?;
    be.synchronize().map_err(e)?;
    let buf_h = be.download(&buf).map_err(e)?;
    let bytes = |t: &Tensor| t.host().map(HostData::to_le_bytes).unwrap_or_default();
    if bytes(&buf_h) != bytes(&out_h) {
        return Err("forward(Some(buf)) differs from forward(None) bit for bit".into());
    }
    if bytes(&be.download(&lbuf).map_err(e)?) != bytes(&lse_h) {
        return Err("lse written into a buffer differs from the allocated lse bit for bit".into());
    }
    Ok(Got { out: out_h.to_f64_vec().map_err(e)?, lse: lse_h.to_f64_vec().map_err(e)? })
}

/// Returns false when any comparison failed.
pub fn check(backends: &[Box<dyn AttentionBackend>], cases: usize, seed: u64, verbose: bool) -> bool {
    let names: Vec<&str> = backends.iter().map(|b| b.name()).collect();
    println!(
        "attnkit check: {cases} random cases, seed {seed}, backends {} (each vs the f64 reference and vs each other)",
        names.join(", ")
    );
    let mut tallies: Vec<Tally> = backends.iter().map(|_| Tally::default()).collect();
    let n = backends.len();
    // Pairwise: (cases compared, worst |a - b| / (2 * tolerance), failures).
    let mut pairs = vec![vec![(0usize, 0.0f64, 0usize); n]; n];
    let mut rng = Rng::new(seed);
    for ci in 0..cases {
        let spec = Spec::draw(&mut rng, &DIMS, seed.wrapping_mul(1_000_003).wrapping_add(ci as u64));
        let case = spec.build();
        let call = case.call().with_lse(true);
        // The f64 reference, not rounded to the case's dtype.
        let checked = match attnkit::validate(&call, Device::Host, "check", None, None) {
            Ok(c) => c,
            Err(e) => {
                println!("case {ci}: the generator made an invalid case ({e}): {spec:?}");
                return false;
            }
        };
        let (want_out, want_lse) = match attnkit::reference::attention_f64(&checked) {
            Ok(r) => r,
            Err(e) => {
                println!("case {ci}: the reference failed ({e}): {spec:?}");
                return false;
            }
        };
        let (atol, rtol) = tol(spec.dtype);
        let problem = checked.problem(true);
        let mut got: Vec<Option<Got>> = Vec::with_capacity(n);
        for (bi, be) in backends.iter().enumerate() {
            let t = &mut tallies[bi];
            if be.supports(&problem).is_err() {
                t.unsupported += 1;
                got.push(None);
                continue;
            }
            t.cases += 1;
            let what = format!("case {ci} on {}: {spec:?}", be.name());
            match run(be.as_ref(), &case) {
                Err(e) => {
                    t.fail(format!("{what}\n  {e}"));
                    got.push(None);
                }
                Ok(g) => {
                    let o = worst(&g.out, &want_out, atol, rtol);
                    let l = worst(&g.lse, &want_lse, 1e-3, 1e-4);
                    match (o, l) {
                        (Ok((eo, _)), Ok((el, _))) if eo <= 1.0 && el <= 1.0 => {
                            t.passed += 1;
                            t.worst = t.worst.max(eo).max(el);
                            got.push(Some(g));
                        }
                        (o, l) => {
                            let detail = match (o, l) {
                                (Err(e), _) => format!("out{e}"),
                                (_, Err(e)) => format!("lse{e}"),
                                (Ok((eo, io)), Ok((el, il))) => {
                                    if eo > 1.0 {
                                        format!(
                                            "out[{io}]: got {}, want {}, {eo:.2}x the tolerance (atol {atol}, rtol {rtol})",
                                            g.out[io], want_out[io]
                                        )
                                    } else {
                                        format!(
                                            "lse[{il}]: got {}, want {}, {el:.2}x the tolerance",
                                            g.lse[il], want_lse[il]
                                        )
                                    }
                                }
                            };
                            t.worst = f64::INFINITY;
                            t.fail(format!("{what}\n  {detail}"));
                            got.push(None);
                        }
                    }
                }
            }
        }
        for a in 0..n {
            for b in a + 1..n {
                if let (Some(x), Some(y)) = (&got[a], &got[b]) {
                    let p = &mut pairs[a][b];
                    p.0 += 1;
                    match worst(&x.out, &y.out, 2.0 * atol, 2.0 * rtol) {
                        Ok((e, _)) => {
                            p.1 = p.1.max(e);
                            if e > 1.0 {
                                p.2 += 1;
                            }
                        }
                        Err(_) => p.2 += 1,
                    }
                }
            }
        }
        if verbose {
            println!("case {ci}: {spec:?}");
        }
    }

    let mut ok = true;
    println!();
    println!(
        "{:<10} {:>6} {:>7} {:>7} {:>12} {:>14}  result",
        "backend", "cases", "passed", "failed", "unsupported", "worst err/tol"
    );
    for (bi, t) in tallies.iter().enumerate() {
        let res = if t.failed > 0 {
            ok = false;
            "FAIL"
        } else if t.cases == 0 {
            "none run"
        } else {
            "pass"
        };
        println!(
            "{:<10} {:>6} {:>7} {:>7} {:>12} {:>14.3}  {res}",
            names[bi], t.cases, t.passed, t.failed, t.unsupported, t.worst
        );
    }
    if n > 1 {
        println!();
        println!("{:<22} {:>6} {:>16} {:>7}  result", "pair", "cases", "worst diff/2tol", "failed");
        for a in 0..n {
            for b in a + 1..n {
                let (c, w, f) = pairs[a][b];
                let res = if f > 0 {
                    ok = false;
                    "FAIL"
                } else {
                    "pass"
                };
                println!("{:<22} {c:>6} {w:>16.3} {f:>7}  {res}", format!("{} ~ {}", names[a], names[b]));
            }
        }
    }
    for (bi, t) in tallies.iter().enumerate() {
        if let Some(f) = &t.first_failure {
            println!("\nfirst failure on {}: {f}", names[bi]);
        }
    }
    println!("\n{}", if ok { "check passed" } else { "check FAILED" });
    ok
}
