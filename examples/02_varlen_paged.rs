//! A ragged batch two ways: packed (varlen, with `cu_seqlens`) and through a paged KV cache with
//! a block table, as a serving engine holds it. Both give the same answer.
//!
//! `cargo run --release --example 02_varlen_paged`

use attnkit::{AttnCall, DType, Tensor};

fn main() -> attnkit::Result<()> {
    let be = attnkit::best(None)?.backend;
    println!("backend {} on {}", be.name(), be.device());
    let (hq, hkv, d) = (4, 1, 32);
    let dtype = DType::F32;
    // Three sequences: (new queries, total kv tokens). The queries are the last tokens of each.
    let lens = [(5usize, 40usize), (1, 17), (3, 3)];
    let mut x = 0.3f32;
    let mut rand = |n: usize| -> Vec<f32> {
        (0..n)
            .map(|_| {
                x = (x * 3.9 * (1.0 - x)).clamp(1e-3, 1.0 - 1e-3); // logistic map: never zero
                x * 2.0 - 1.0
            })
            .collect()
    };

    // Varlen: every sequence's tokens packed one after another.
    let cu = |f: fn(&(usize, usize)) -> usize| {
        let mut v = vec![0i32];
        for l in &lens {
            v.push(v.last().unwrap() + f(l) as i32);
        }
        v
    };
    let (cu_q, cu_k) = (cu(|l| l.0), cu(|l| l.1));
    let (tq, tk) = (*cu_q.last().unwrap() as usize, *cu_k.last().unwrap() as usize);
    let q_host = rand(tq * hq * d);
    let k_host = rand(tk * hkv * d);
    let v_host = rand(tk * hkv * d);
    let q = be.upload(&Tensor::from_f32(&[tq, hq, d], dtype, &q_host)?)?;
    let k = be.upload(&Tensor::from_f32(&[tk, hkv, d], dtype, &k_host)?)?;
    let v = be.upload(&Tensor::from_f32(&[tk, hkv, d], dtype, &v_host)?)?;
    let varlen = AttnCall::varlen(&q, &k, &v, &cu_q, &cu_k).causal(true);
    let mut out_varlen = be.alloc(&[tq, hq, d], dtype)?;
    be.forward(&varlen, Some(&mut out_varlen), None)?;

    // Paged: the same keys in blocks of 8 tokens, handed out in reverse order; slots no token uses
    // hold NaN, which must never reach the result.
    let bs = 8;
    let row = hkv * d;
    let max_blocks = lens.iter().map(|l| l.1.div_ceil(bs)).max().unwrap();
    let num_blocks = lens.iter().map(|l| l.1.div_ceil(bs)).sum::<usize>();
    let mut k_cache = vec![f32::NAN; num_blocks * bs * row];
    let mut v_cache = vec![f32::NAN; num_blocks * bs * row];
    let mut block_table = vec![0i32; lens.len() * max_blocks];
    let mut next = num_blocks;
    for (s, &(_, lk)) in lens.iter().enumerate() {
        for j in 0..lk.div_ceil(bs) {
            next -= 1;
            block_table[s * max_blocks + j] = next as i32;
        }
        for t in 0..lk {
            let src = (cu_k[s] as usize + t) * row;
            let dst = (block_table[s * max_blocks + t / bs] as usize * bs + t % bs) * row;
            k_cache[dst..dst + row].copy_from_slice(&k_host[src..src + row]);
            v_cache[dst..dst + row].copy_from_slice(&v_host[src..src + row]);
        }
    }
    let seq_lens: Vec<i32> = lens.iter().map(|l| l.1 as i32).collect();
    let kc = be.upload(&Tensor::from_f32(&[num_blocks, bs, hkv, d], dtype, &k_cache)?)?;
    let vc = be.upload(&Tensor::from_f32(&[num_blocks, bs, hkv, d], dtype, &v_cache)?)?;
    let paged = AttnCall::paged(&q, &kc, &vc, &cu_q, &block_table, max_blocks, &seq_lens).causal(true);
    let mut out_paged = be.alloc(&[tq, hq, d], dtype)?;
    be.forward(&paged, Some(&mut out_paged), None)?;

    let a = be.download(&out_varlen)?.to_f64_vec()?;
    let b = be.download(&out_paged)?.to_f64_vec()?;
    let diff = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max);
    println!(
        "varlen vs paged: max |diff| = {diff:e} over {} values, any NaN: {}",
        a.len(),
        b.iter().any(|x| x.is_nan())
    );
    assert!(diff < 1e-4 && b.iter().all(|x| x.is_finite()));

    // A block-table entry out of range is a typed error that names it.
    let mut bad = block_table.clone();
    bad[0] = 99;
    let call = AttnCall::paged(&q, &kc, &vc, &cu_q, &bad, max_blocks, &seq_lens);
    println!("bad block table: {}", be.forward(&call, Some(&mut out_paged), None).unwrap_err());
    Ok(())
}
