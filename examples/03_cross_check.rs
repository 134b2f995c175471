//! Run one problem on every backend present and compare each with the f64 reference and with each
//! other, within the contract's tolerances. (`attnkit check` does this on many random problems.)
//!
//! `cargo run --release --example 03_cross_check --features wgpu,cuda`

use attnkit::{AttnCall, DType, Tensor};

fn main() -> attnkit::Result<()> {
    let (b, sq, sk, hq, hkv, d) = (2, 48, 80, 8, 2, 64);
    let dtype = DType::BF16;
    let (atol, rtol) = (1.6e-2, 2e-2); // the contract's bf16 tolerance
    let gen = |n: usize, salt: f32| -> Vec<f32> { (0..n).map(|i| ((i as f32 + salt) * 0.618).sin()).collect() };
    let q = Tensor::from_f32(&[b, sq, hq, d], dtype, &gen(b * sq * hq * d, 0.5))?;
    let k = Tensor::from_f32(&[b, sk, hkv, d], dtype, &gen(b * sk * hkv * d, 1.5))?;
    let v = Tensor::from_f32(&[b, sk, hkv, d], dtype, &gen(b * sk * hkv * d, 2.5))?;
    let slopes: Vec<f32> = (0..hq).map(|h| 0.5f32.powi(h as i32 + 1)).collect();
    // The f64 reference, unrounded (the `reference` backend would round its output to bf16).
    let call = with(&q, &k, &v, &slopes);
    let checked = attnkit::validate(&call, attnkit::Device::Host, "reference", None, None)?;
    let (want, _lse) = attnkit::reference::attention_f64(&checked)?;

    let mut results: Vec<(&'static str, Vec<f64>)> = Vec::new();
    for name in attnkit::BACKENDS {
        if name == "reference" {
            continue;
        }
        let be = match attnkit::by_name(name) {
            Ok(be) => be,
            Err(e) => {
                println!("{name:<9} not run: {e}");
                continue;
            }
        };
        let (qd, kd, vd) = (be.upload(&q)?, be.upload(&k)?, be.upload(&v)?);
        let call = with(&qd, &kd, &vd, &slopes);
        let out = match be.forward(&call, None, None) {
            Ok(o) => be.download(o.out.as_ref().expect("allocated"))?.to_f64_vec()?,
            Err(e) => {
                println!("{name:<9} declined: {e}");
                continue;
            }
        };
        let worst = out.iter().zip(&want).map(|(g, w)| (g - w).abs() / (atol + rtol * w.abs())).fold(0.0, f64::max);
        println!(
            "{name:<9} vs reference: worst error {worst:.4} of the tolerance  {}",
            if worst <= 1.0 { "ok" } else { "MISMATCH" }
        );
        results.push((name, out));
    }
    for (i, (a, x)) in results.iter().enumerate() {
        for (c, y) in &results[i + 1..] {
            let worst = x
                .iter()
                .zip(y)
                .zip(&want)
                .map(|((p, q), w)| (p - q).abs() / (2.0 * (atol + rtol * w.abs())))
                .fold(0.0, f64::max);
            println!("{a} vs {c}: worst difference {worst:.3} of twice the tolerance");
        }
    }
    Ok(())
}

/// Causal, a left window, softcap and ALiBi: most of the contract in one call.
fn with<'a>(q: &'a Tensor, k: &'a Tensor, v: &'a Tensor, slopes: &'a [f32]) -> AttnCall<'a> {
    AttnCall::dense(q, k, v).causal(true).window(Some(32), None).softcap(Some(30.0)).alibi(Some(slopes))
}
