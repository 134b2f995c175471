//! Dense attention on the best backend present, writing into one caller-owned buffer that is
//! reused across calls (no allocation per call).
//!
//! `cargo run --release --example 01_dense` (add `--features cuda` or `--features wgpu` for a GPU).

use attnkit::{AttnCall, DType, Problem, Tensor};

fn main() -> attnkit::Result<()> {
    let (b, s, hq, hkv, d) = (2, 256, 8, 2, 64);
    let dtype = DType::F16;

    // The fastest backend compiled in that supports this problem; it says why it passed others.
    let mut problem = Problem::new(dtype, d);
    problem.num_heads_q = hq;
    problem.num_heads_kv = hkv;
    problem.causal = true;
    let sel = attnkit::best(Some(&problem))?;
    for (name, why) in &sel.skipped {
        println!("skipped {name}: {why}");
    }
    let be = sel.backend;
    println!("backend {} on {}", be.name(), be.device());

    // Random host inputs, uploaded once (GQA: 8 query heads share 2 kv heads).
    let mut seed = 1u64;
    let mut rand = |n: usize| -> Vec<f32> {
        (0..n)
            .map(|_| {
                seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                (seed >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
            })
            .collect()
    };
    let q = be.upload(&Tensor::from_f32(&[b, s, hq, d], dtype, &rand(b * s * hq * d))?)?;
    let k = be.upload(&Tensor::from_f32(&[b, s, hkv, d], dtype, &rand(b * s * hkv * d))?)?;
    let v = be.upload(&Tensor::from_f32(&[b, s, hkv, d], dtype, &rand(b * s * hkv * d))?)?;

    // Output and lse buffers, allocated once on the backend's device.
    let mut out = be.alloc(&[b, s, hq, d], dtype)?;
    let mut lse = be.alloc(&[b, hq, s], DType::F32)?;

    let call = AttnCall::dense(&q, &k, &v).causal(true);
    for step in 0..3 {
        let t = std::time::Instant::now();
        be.forward(&call, Some(&mut out), Some(&mut lse))?;
        be.synchronize()?;
        println!("step {step}: {:.3} ms", t.elapsed().as_secs_f64() * 1e3);
    }

    let out = be.download(&out)?.to_f64_vec()?;
    let lse = be.download(&lse)?.to_f64_vec()?;
    println!("out[0..4] = {:?}", &out[..4]);
    println!("lse[0..4] = {:?}  (query 0 sees one key under the causal mask)", &lse[..4]);

    // A wrong buffer is a typed error before anything runs, and the buffer is left as it was.
    let mut wrong = be.alloc(&[b, s, hq, d + 1], dtype)?;
    let err = be.forward(&call, Some(&mut wrong), None).unwrap_err();
    println!("wrong buffer: {err}");
    Ok(())
}
