//! A small Llama-style decoder (RMSNorm, RoPE, GQA, SwiGLU; random weights through candle-nn)
//! generating greedily with attnkit's paged attention on a paged KV cache, checked at every step
//! against the same model with candle's own matmul-softmax attention, and timed against it.
//!
//! ```text
//! cargo run --release --example 10_llama_paged --features candle
//! ```

#[path = "common/llama.rs"]
mod llama;

use candle_core::Device;
use llama::{Config, Llama};

fn main() -> candle_core::Result<()> {
    let cfg = Config {
        vocab: 4096,
        hidden: 512,
        layers: 4,
        heads: 8,
        kv_heads: 2,
        intermediate: 1408,
        rope_theta: 10_000.0,
        eps: 1e-5,
        max_pos: 4096,
    };
    let model = Llama::new(cfg, 42, &Device::Cpu)?;
    let lens = [96, 160, 224, 384];
    let steps = 32;
    let block_size = 16;
    let prompts = llama::prompts(&lens, cfg.vocab, 7);
    println!(
        "model: hidden {}, {} layers, {} q heads / {} kv heads of {}, SwiGLU {}, vocab {}",
        cfg.hidden,
        cfg.layers,
        cfg.heads,
        cfg.kv_heads,
        cfg.head_dim(),
        cfg.intermediate,
        cfg.vocab
    );
    println!(
        "batch: {} sequences, prompts {lens:?}, {steps} greedy steps, KV blocks of {block_size}; timings: best of 3",
        lens.len()
    );

    let (ours, theirs) = llama::compare(&model, &prompts, steps, block_size, 3)?;
    let (diff, mag) = llama::max_diff(&ours.logits, &theirs.logits)?;
    // Both are f32 models that differ only in how attention sums; 1e-4 of the logits' scale is
    // the f32 contract's rtol.
    let tol = 1e-4 * mag.max(1.0);
    println!(
        "logits: max |attnkit - candle| = {diff:.3e} over {} steps (max |logit| {mag:.2}, tolerance {tol:.1e})",
        steps + 1
    );
    let decoded = (lens.len() * steps) as f64;
    let prefilled: usize = lens.iter().sum();
    for (name, r) in [("attnkit paged", &ours), ("candle matmul-softmax", &theirs)] {
        println!(
            "{name:>22}: prefill {:8.1} tok/s, decode {:7.1} tok/s; attention {:6.1} ms of {:6.1} ms prefill, {:6.1} ms of {:6.1} ms decode",
            prefilled as f64 / r.prefill_secs,
            decoded / r.decode_secs,
            r.prefill_attn_secs * 1e3,
            r.prefill_secs * 1e3,
            r.decode_attn_secs * 1e3,
            r.decode_secs * 1e3,
        );
    }
    println!(
        "attnkit / candle, same run: decode throughput {:.2}x, decode attention time {:.2}x less, prefill attention time {:.2}x less",
        theirs.decode_secs / ours.decode_secs,
        theirs.decode_attn_secs / ours.decode_attn_secs,
        theirs.prefill_attn_secs / ours.prefill_attn_secs,
    );
    println!("first tokens of sequence 0: {:?}", &ours.tokens[0][..8.min(steps)]);
    if diff > tol {
        candle_core::bail!("attnkit and candle attention disagree: {diff:.3e} > {tol:.1e}");
    }
    println!("ok");
    Ok(())
}
