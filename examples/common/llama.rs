//! A small Llama-style decoder (RMSNorm, RoPE, GQA attention, SwiGLU MLP) with deterministic
//! random weights, written once over an attention [`Engine`]: attnkit's paged attention on a
//! [`PagedKvCache`], or candle's own matmul-softmax-matmul on per-sequence K/V it concatenates.
//! Shared by `examples/10_llama_paged.rs` and `tests/candle.rs`.
#![allow(dead_code)]

use std::collections::HashMap;
use std::time::Instant;

use attnkit::candle::{PagedBatch, PagedKvCache};
use candle_core::{DType, Device, Module, Result, Tensor, D};
use candle_nn::{embedding, linear_no_bias, Embedding, Linear, VarBuilder};

/// Model sizes.
#[derive(Clone, Copy, Debug)]
pub struct Config {
    pub vocab: usize,
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub intermediate: usize,
    pub rope_theta: f64,
    pub eps: f64,
    pub max_pos: usize,
}

impl Config {
    pub fn head_dim(&self) -> usize {
        self.hidden / self.heads
    }
}

/// splitmix64 uniforms: the same weights on every machine, no RNG crate.
struct Rng(u64);
impl Rng {
    fn uniform(&mut self) -> f32 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        ((z >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

/// RMSNorm. candle-nn's fused ops (RMSNorm, RoPE, softmax) have CUDA kernels only with
/// candle-nn's own `cuda` feature, which attnkit does not turn on (candle-nn is only a
/// dev-dependency): on a device other than the CPU the model uses their plain-tensor-op forms.
struct RmsNorm {
    w: Tensor,
    eps: f64,
}

fn rms_norm(h: usize, eps: f64, vb: VarBuilder) -> Result<RmsNorm> {
    Ok(RmsNorm { w: vb.get(h, "weight")?, eps })
}

impl RmsNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if x.device().is_cpu() {
            candle_nn::ops::rms_norm(&x.contiguous()?, &self.w, self.eps as f32)
        } else {
            candle_nn::ops::rms_norm_slow(x, &self.w, self.eps as f32)
        }
    }
}

/// RoPE on `[1, T, H, D]` (halves rotated), as candle-nn's `rope_thd`.
fn rope_thd(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    if x.device().is_cpu() {
        return candle_nn::rotary_emb::rope_thd(x, cos, sin);
    }
    let d = x.dim(D::Minus1)?;
    let (x1, x2) = (x.narrow(D::Minus1, 0, d / 2)?, x.narrow(D::Minus1, d / 2, d / 2)?);
    let rot = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
    // cos, sin `[T, D/2]` -> `[1, T, 1, D]`.
    let full = |c: &Tensor| -> Result<Tensor> { Tensor::cat(&[c, c], D::Minus1)?.unsqueeze(0)?.unsqueeze(2) };
    x.broadcast_mul(&full(cos)?)? + rot.broadcast_mul(&full(sin)?)?
}

/// Softmax over the last dimension.
fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    if x.device().is_cpu() {
        candle_nn::ops::softmax_last_dim(x)
    } else {
        candle_nn::ops::softmax(x, D::Minus1)
    }
}

struct Layer {
    ln1: RmsNorm,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    ln2: RmsNorm,
    gate: Linear,
    up: Linear,
    down: Linear,
}

/// The decoder.
pub struct Llama {
    pub cfg: Config,
    pub dtype: DType,
    embed: Embedding,
    layers: Vec<Layer>,
    norm: RmsNorm,
    lm_head: Linear,
    cos: Tensor,
    sin: Tensor,
}

/// Attention inside the model: called once per layer per step with the step's new tokens.
pub trait Engine {
    /// Start a step: `new[b]` new tokens for sequence `b` (every sequence, in order; 0 is allowed).
    /// Returns each new token's position in its sequence.
    fn begin(&mut self, new: &[usize]) -> Result<Vec<u32>>;
    /// q `[T, Hq, D]`, k and v `[T, Hkv, D]` of the step's new tokens (RoPE applied) to the
    /// attention output `[T, Hq, D]`, causal over each sequence's cached and new tokens.
    fn attend(&mut self, layer: usize, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor>;
    fn name(&self) -> &'static str;
    /// Seconds spent in `attend` so far (cache writes included).
    fn attn_secs(&self) -> f64;
}

impl Llama {
    /// The device the weights are on.
    pub fn device(&self) -> &Device {
        self.cos.device()
    }

    /// Random weights from `seed`: linears uniform with the variance of `1 / fan_in`, embeddings
    /// uniform in [-1, 1), norm weights near 1; drawn in f32, stored and run in `dtype`.
    pub fn new(cfg: Config, seed: u64, dtype: DType, dev: &Device) -> Result<Self> {
        let mut rng = Rng(seed);
        let mut ts = HashMap::new();
        let mut put = |name: String, rows: usize, cols: usize, amp: f32, base: f32| -> Result<()> {
            let v: Vec<f32> = (0..rows * cols).map(|_| base + amp * rng.uniform()).collect();
            let t = if rows == 1 { Tensor::from_vec(v, cols, dev)? } else { Tensor::from_vec(v, (rows, cols), dev)? };
            ts.insert(name, t);
            Ok(())
        };
        let (h, d) = (cfg.hidden, cfg.head_dim());
        let lin = |fan_in: usize| (3.0 / fan_in as f32).sqrt();
        put("embed.weight".into(), cfg.vocab, h, 1.0, 0.0)?;
        for l in 0..cfg.layers {
            let p = format!("layers.{l}");
            put(format!("{p}.ln1.weight"), 1, h, 0.1, 1.0)?;
            put(format!("{p}.ln2.weight"), 1, h, 0.1, 1.0)?;
            put(format!("{p}.q.weight"), cfg.heads * d, h, lin(h), 0.0)?;
            put(format!("{p}.k.weight"), cfg.kv_heads * d, h, lin(h), 0.0)?;
            put(format!("{p}.v.weight"), cfg.kv_heads * d, h, lin(h), 0.0)?;
            put(format!("{p}.o.weight"), h, cfg.heads * d, lin(h), 0.0)?;
            put(format!("{p}.gate.weight"), cfg.intermediate, h, lin(h), 0.0)?;
            put(format!("{p}.up.weight"), cfg.intermediate, h, lin(h), 0.0)?;
            put(format!("{p}.down.weight"), h, cfg.intermediate, lin(cfg.intermediate), 0.0)?;
        }
        put("norm.weight".into(), 1, h, 0.1, 1.0)?;
        put("lm_head.weight".into(), cfg.vocab, h, lin(h), 0.0)?;
        let vb = VarBuilder::from_tensors(ts, dtype, dev);

        let mut layers = Vec::new();
        for l in 0..cfg.layers {
            let vb = vb.pp(format!("layers.{l}"));
            layers.push(Layer {
                ln1: rms_norm(h, cfg.eps, vb.pp("ln1"))?,
                q: linear_no_bias(h, cfg.heads * d, vb.pp("q"))?,
                k: linear_no_bias(h, cfg.kv_heads * d, vb.pp("k"))?,
                v: linear_no_bias(h, cfg.kv_heads * d, vb.pp("v"))?,
                o: linear_no_bias(cfg.heads * d, h, vb.pp("o"))?,
                ln2: rms_norm(h, cfg.eps, vb.pp("ln2"))?,
                gate: linear_no_bias(h, cfg.intermediate, vb.pp("gate"))?,
                up: linear_no_bias(h, cfg.intermediate, vb.pp("up"))?,
                down: linear_no_bias(cfg.intermediate, h, vb.pp("down"))?,
            });
        }
        let inv: Vec<f32> = (0..d / 2).map(|i| 1.0 / cfg.rope_theta.powf(2.0 * i as f64 / d as f64) as f32).collect();
        let inv = Tensor::from_vec(inv, (1, d / 2), dev)?;
        let pos = Tensor::arange(0u32, cfg.max_pos as u32, dev)?.to_dtype(DType::F32)?.reshape((cfg.max_pos, 1))?;
        let freqs = pos.broadcast_mul(&inv)?;
        Ok(Llama {
            cfg,
            dtype,
            embed: embedding(cfg.vocab, h, vb.pp("embed"))?,
            layers,
            norm: rms_norm(h, cfg.eps, vb.pp("norm"))?,
            lm_head: linear_no_bias(h, cfg.vocab, vb.pp("lm_head"))?,
            cos: freqs.cos()?.to_dtype(dtype)?,
            sin: freqs.sin()?.to_dtype(dtype)?,
        })
    }

    /// Logits `[T, vocab]` of a step's new tokens (packed, sequence by sequence).
    pub fn forward(&self, tokens: &[u32], positions: &[u32], engine: &mut dyn Engine) -> Result<Tensor> {
        let cfg = &self.cfg;
        let (t, d) = (tokens.len(), cfg.head_dim());
        let dev = self.cos.device();
        let pos = Tensor::new(positions, dev)?;
        let (cos, sin) = (self.cos.index_select(&pos, 0)?, self.sin.index_select(&pos, 0)?);
        let rope = |x: Tensor, heads: usize| -> Result<Tensor> {
            rope_thd(&x.reshape((1, t, heads, d))?, &cos, &sin)?.reshape((t, heads, d))
        };
        let mut x = self.embed.forward(&Tensor::new(tokens, dev)?)?;
        for (l, layer) in self.layers.iter().enumerate() {
            let h = layer.ln1.forward(&x)?;
            let q = rope(layer.q.forward(&h)?, cfg.heads)?;
            let k = rope(layer.k.forward(&h)?, cfg.kv_heads)?;
            let v = layer.v.forward(&h)?.reshape((t, cfg.kv_heads, d))?;
            let a = engine.attend(l, &q, &k, &v)?;
            x = (x + layer.o.forward(&a.reshape((t, cfg.heads * d))?)?)?;
            let h = layer.ln2.forward(&x)?;
            let mlp =
                layer.down.forward(&(candle_nn::ops::silu(&layer.gate.forward(&h)?)? * layer.up.forward(&h)?)?)?;
            x = (x + mlp)?;
        }
        self.lm_head.forward(&self.norm.forward(&x)?)
    }
}

/// Attention timing: on a GPU the work is asynchronous, so the device is synchronised on both
/// sides of the timed region (both engines pay the same).
fn start(dev: &Device) -> Result<Instant> {
    if !dev.is_cpu() {
        dev.synchronize()?;
    }
    Ok(Instant::now())
}

fn stop(dev: &Device, t0: Instant) -> Result<f64> {
    if !dev.is_cpu() {
        dev.synchronize()?;
    }
    Ok(t0.elapsed().as_secs_f64())
}

/// attnkit: new keys and values go into a [`PagedKvCache`] by slot, attention is one paged call
/// per layer into an output buffer allocated once per step and shared by all layers.
pub struct PagedEngine {
    pub cache: PagedKvCache,
    seqs: Vec<usize>,
    batch: PagedBatch,
    out: Option<Tensor>,
    secs: f64,
}

impl PagedEngine {
    pub fn new(model: &Llama, sequences: usize, num_blocks: usize, block_size: usize, dev: &Device) -> Result<Self> {
        let cfg = &model.cfg;
        let mut cache =
            PagedKvCache::new(cfg.layers, num_blocks, block_size, cfg.kv_heads, cfg.head_dim(), model.dtype, dev)?;
        let seqs = (0..sequences).map(|_| cache.add_sequence()).collect();
        Ok(PagedEngine { cache, seqs, batch: PagedBatch::default(), out: None, secs: 0.0 })
    }
}

impl Engine for PagedEngine {
    fn begin(&mut self, new: &[usize]) -> Result<Vec<u32>> {
        let b: Vec<(usize, usize)> = self.seqs.iter().copied().zip(new.iter().copied()).collect();
        self.batch = self.cache.step(&b)?;
        self.out = None;
        Ok(self.batch.positions.clone())
    }
    fn attend(&mut self, layer: usize, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        let t0 = start(q.device())?;
        self.cache.append(layer, k, v, &self.batch)?;
        if self.out.as_ref().map(|o| o.dims() != q.dims()).unwrap_or(true) {
            self.out = Some(Tensor::zeros(q.dims(), q.dtype(), q.device())?);
        }
        let out = self.out.as_ref().expect("allocated above");
        let attn = self.batch.attn().causal(true);
        attn.forward_into(q, self.cache.k_cache(layer), self.cache.v_cache(layer), out, None)?;
        self.secs += stop(q.device(), t0)?;
        // A view of the buffer: the next layer overwrites it after o_proj has read this one.
        Ok(out.clone())
    }
    fn name(&self) -> &'static str {
        "attnkit paged"
    }
    fn attn_secs(&self) -> f64 {
        self.secs
    }
}

/// candle: per sequence and layer, K and V `[Hkv, S, D]` grown with `Tensor::cat`; attention is
/// `softmax(q kᵀ * scale + causal mask) v` with the kv heads repeated for GQA.
pub struct CandleEngine {
    /// `[layer][sequence]` (K, V).
    kv: Vec<Vec<Option<(Tensor, Tensor)>>>,
    lens: Vec<usize>,
    new: Vec<usize>,
    secs: f64,
}

impl CandleEngine {
    pub fn new(cfg: &Config, sequences: usize) -> Self {
        CandleEngine { kv: vec![vec![None; sequences]; cfg.layers], lens: vec![0; sequences], new: vec![], secs: 0.0 }
    }
}

impl Engine for CandleEngine {
    fn begin(&mut self, new: &[usize]) -> Result<Vec<u32>> {
        let mut pos = Vec::new();
        for (b, &n) in new.iter().enumerate() {
            pos.extend((self.lens[b]..self.lens[b] + n).map(|p| p as u32));
            self.lens[b] += n;
        }
        self.new = new.to_vec();
        Ok(pos)
    }
    fn attend(&mut self, layer: usize, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        let t0 = start(q.device())?;
        let (_, hq, d) = q.dims3()?;
        let hkv = k.dim(1)?;
        let scale = 1.0 / (d as f64).sqrt();
        let mut outs = Vec::new();
        let mut row = 0;
        for (b, &n) in self.new.iter().enumerate() {
            if n == 0 {
                continue;
            }
            let qb = q.narrow(0, row, n)?.transpose(0, 1)?.contiguous()?; // [Hq, n, D]
            let kb = k.narrow(0, row, n)?.transpose(0, 1)?.contiguous()?; // [Hkv, n, D]
            let vb = v.narrow(0, row, n)?.transpose(0, 1)?.contiguous()?;
            row += n;
            let (kc, vc) = match self.kv[layer][b].take() {
                Some((kc, vc)) => (Tensor::cat(&[&kc, &kb], 1)?, Tensor::cat(&[&vc, &vb], 1)?),
                None => (kb, vb),
            };
            self.kv[layer][b] = Some((kc.clone(), vc.clone()));
            let s = kc.dim(1)?;
            let rep = |x: &Tensor| -> Result<Tensor> {
                // [Hkv, S, D] -> [Hq, S, D]: each kv head serves hq / hkv query heads.
                x.unsqueeze(1)?.expand((hkv, hq / hkv, s, d))?.reshape((hq, s, d))
            };
            let (kr, vr) = (rep(&kc)?, rep(&vc)?);
            let scores = (qb.matmul(&kr.t()?)? * scale)?; // [Hq, n, S]
                                                          // Query i of the n new tokens sits at position s - n + i and sees keys 0..=s - n + i.
            let mask: Vec<f32> = (0..n)
                .flat_map(|i| (0..s).map(move |j| if j <= s - n + i { 0.0 } else { f32::NEG_INFINITY }))
                .collect();
            let mask = Tensor::from_vec(mask, (1, n, s), q.device())?.to_dtype(q.dtype())?;
            let p = softmax_last_dim(&scores.broadcast_add(&mask)?)?;
            outs.push(p.matmul(&vr)?.transpose(0, 1)?); // [n, Hq, D]
        }
        let out = Tensor::cat(&outs, 0)?;
        self.secs += stop(q.device(), t0)?;
        Ok(out)
    }
    fn name(&self) -> &'static str {
        "candle matmul-softmax"
    }
    fn attn_secs(&self) -> f64 {
        self.secs
    }
}

/// What one generation run produced.
pub struct Run {
    /// Per step, the last-token logits of every sequence `[B, vocab]` (step 0 is the prefill).
    pub logits: Vec<Tensor>,
    /// Per sequence, the generated tokens.
    pub tokens: Vec<Vec<u32>>,
    pub prefill_secs: f64,
    pub decode_secs: f64,
    /// Of which in attention (K/V cache writes included).
    pub prefill_attn_secs: f64,
    pub decode_attn_secs: f64,
}

fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in row.iter().enumerate() {
        if x > row[best] {
            best = i;
        }
    }
    best as u32
}

/// Greedy generation of `steps` tokens after a prefill of `prompts`. With `forced`, the next
/// tokens are taken from it instead of the argmax (to run a second engine in lockstep).
pub fn generate(
    model: &Llama,
    engine: &mut dyn Engine,
    prompts: &[Vec<u32>],
    steps: usize,
    forced: Option<&[Vec<u32>]>,
) -> Result<Run> {
    let b = prompts.len();
    let mut run = Run {
        logits: vec![],
        tokens: vec![vec![]; b],
        prefill_secs: 0.0,
        decode_secs: 0.0,
        prefill_attn_secs: 0.0,
        decode_attn_secs: 0.0,
    };
    let attn0 = engine.attn_secs();
    let mut step_tokens: Vec<Vec<u32>> = prompts.to_vec();
    for step in 0..=steps {
        let t0 = Instant::now();
        let new: Vec<usize> = step_tokens.iter().map(Vec::len).collect();
        let positions = engine.begin(&new)?;
        let flat: Vec<u32> = step_tokens.concat();
        let logits = model.forward(&flat, &positions, engine)?;
        // The last new token of each sequence.
        let mut last = Vec::with_capacity(b);
        let mut end = 0;
        for n in &new {
            end += n;
            last.push((end - 1) as u32);
        }
        let last = logits.index_select(&Tensor::new(last.as_slice(), logits.device())?, 0)?;
        let last = last.to_dtype(DType::F32)?;
        let rows = last.to_vec2::<f32>()?;
        let dt = t0.elapsed().as_secs_f64();
        if step == 0 {
            run.prefill_secs += dt;
            run.prefill_attn_secs = engine.attn_secs() - attn0;
        } else {
            run.decode_secs += dt;
        }
        run.logits.push(last);
        if step == steps {
            break;
        }
        for (s, row) in rows.iter().enumerate() {
            let next = match forced {
                Some(f) => f[s][step],
                None => argmax(row),
            };
            run.tokens[s].push(next);
            step_tokens[s] = vec![next];
        }
    }
    run.decode_attn_secs = engine.attn_secs() - attn0 - run.prefill_attn_secs;
    Ok(run)
}

/// Prompts of the given lengths, deterministic.
pub fn prompts(lens: &[usize], vocab: usize, seed: u64) -> Vec<Vec<u32>> {
    let mut rng = Rng(seed);
    lens.iter()
        .map(|&n| (0..n).map(|_| ((rng.uniform() + 1.0) * 0.5 * vocab as f32) as u32 % vocab as u32).collect())
        .collect()
}

/// Largest `|a - b|` over the steps' logits, and the largest `|b|`.
pub fn max_diff(a: &[Tensor], b: &[Tensor]) -> Result<(f32, f32)> {
    let mut diff = 0f32;
    let mut mag = 0f32;
    for (x, y) in a.iter().zip(b) {
        diff = diff.max((x - y)?.abs()?.max_all()?.to_scalar::<f32>()?);
        mag = mag.max(y.abs()?.max_all()?.to_scalar::<f32>()?);
    }
    Ok((diff, mag))
}

/// The attnkit run, then the candle run forced onto the same tokens, each timed alone after a
/// short untimed warm-up of both (thread pools, first-touch allocations). With `reps > 1` the pair
/// runs `reps` times, alternating, and each timing is the best of its runs (the machine may be
/// shared); logits and tokens are the first pair's.
pub fn compare(
    model: &Llama,
    prompts: &[Vec<u32>],
    steps: usize,
    block_size: usize,
    reps: usize,
) -> Result<(Run, Run)> {
    let dev = model.device().clone();
    let need: usize = prompts.iter().map(|p| (p.len() + steps).div_ceil(block_size)).sum();
    let paged = || PagedEngine::new(model, prompts.len(), need + 4, block_size, &dev);
    let warm = steps.min(2);
    generate(model, &mut paged()?, prompts, warm, None)?;
    generate(model, &mut CandleEngine::new(&model.cfg, prompts.len()), prompts, warm, None)?;

    let mut ours = generate(model, &mut paged()?, prompts, steps, None)?;
    let mut reference = CandleEngine::new(&model.cfg, prompts.len());
    let mut theirs = generate(model, &mut reference, prompts, steps, Some(&ours.tokens))?;
    for _ in 1..reps {
        let a = generate(model, &mut paged()?, prompts, steps, None)?;
        let b = generate(model, &mut CandleEngine::new(&model.cfg, prompts.len()), prompts, steps, Some(&ours.tokens))?;
        for (best, r) in [(&mut ours, a), (&mut theirs, b)] {
            best.prefill_secs = best.prefill_secs.min(r.prefill_secs);
            best.decode_secs = best.decode_secs.min(r.decode_secs);
            best.prefill_attn_secs = best.prefill_attn_secs.min(r.prefill_attn_secs);
            best.decode_attn_secs = best.decode_attn_secs.min(r.decode_attn_secs);
        }
    }
    Ok((ours, theirs))
}

/// The same model in f32 and in a lower precision `lp`, all runs on the f32 model's greedy
/// tokens. Returns the largest logit error against the f32 model with candle attention, of the
/// low-precision model with attnkit attention and with candle attention. The FlashAttention rule:
/// attnkit in `lp` may be at most 2x as far from the f32 result as candle's own attention in `lp`.
pub fn low_precision_errors(
    f32_model: &Llama,
    lp_model: &Llama,
    prompts: &[Vec<u32>],
    steps: usize,
    block_size: usize,
) -> Result<(f32, f32)> {
    let dev = f32_model.device().clone();
    let need: usize = prompts.iter().map(|p| (p.len() + steps).div_ceil(block_size)).sum();
    let mut paged = PagedEngine::new(f32_model, prompts.len(), need + 4, block_size, &dev)?;
    let tokens = generate(f32_model, &mut paged, prompts, steps, None)?.tokens;
    let truth =
        generate(f32_model, &mut CandleEngine::new(&f32_model.cfg, prompts.len()), prompts, steps, Some(&tokens))?;
    let mut paged = PagedEngine::new(lp_model, prompts.len(), need + 4, block_size, &dev)?;
    let ours = generate(lp_model, &mut paged, prompts, steps, Some(&tokens))?;
    let theirs =
        generate(lp_model, &mut CandleEngine::new(&lp_model.cfg, prompts.len()), prompts, steps, Some(&tokens))?;
    Ok((max_diff(&ours.logits, &truth.logits)?.0, max_diff(&theirs.logits, &truth.logits)?.0))
}
