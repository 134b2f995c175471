//! A paged KV cache for candle models, in the contract's layout: per layer a key and a value cache
//! `[num_blocks, block_size, Hkv, D]`, shared block bookkeeping, and per step the metadata of an
//! attnkit paged call.

use candle_core::backend::BackendStorage;
use candle_core::{self as cc, CpuStorage, InplaceOp2};

use super::{check_buffer, check_device, contiguous, from_candle, kit_dtype, range, same_storage, Attn, Elem};
use crate::error::{Error, Result};
use crate::types::DType;

/// The metadata of one step over a batch of sequences: the new tokens' slots, and what a paged
/// attention call over the sequences needs ([`attn`](Self::attn)).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PagedBatch {
    /// `[B+1]` prefix sums of the new tokens per sequence: the queries of this step.
    pub cu_seqlens_q: Vec<i32>,
    /// `[B, max_blocks]` row-major block indices; unused entries are 0.
    pub block_table: Vec<i32>,
    /// Columns of `block_table`.
    pub max_blocks: usize,
    /// `[B]` kv length of each sequence, the new tokens included.
    pub seq_lens: Vec<i32>,
    /// `[Tq]` cache slot (`block * block_size + offset`) of each new token.
    pub slot_mapping: Vec<i64>,
    /// `[Tq]` position of each new token in its sequence (for RoPE).
    pub positions: Vec<u32>,
}

impl PagedBatch {
    /// A paged call over this batch (no mask set: add `.causal(true)` for a decoder).
    pub fn attn(&self) -> Attn<'_> {
        Attn::paged(&self.cu_seqlens_q, &self.block_table, self.max_blocks, &self.seq_lens)
    }
    /// Sequences in the batch.
    pub fn batch(&self) -> usize {
        self.seq_lens.len()
    }
    /// New tokens in the batch (`Tq`).
    pub fn num_tokens(&self) -> usize {
        self.slot_mapping.len()
    }
}

#[derive(Clone, Debug, Default)]
struct SeqBlocks {
    blocks: Vec<i32>,
    len: usize,
}

/// Key and value caches of every layer, their free blocks, and the blocks of each sequence.
///
/// A step: [`step`](Self::step) reserves slots for each sequence's new tokens (allocating blocks as
/// needed) and returns a [`PagedBatch`]; each layer then [`append`](Self::append)s its new keys
/// and values and runs `batch.attn().causal(true)` on its caches.
///
/// ```
/// use attnkit::candle::PagedKvCache;
/// use candle_core::{DType, Device, Tensor};
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let (dev, layers, hq, hkv, d) = (Device::Cpu, 2, 8, 2, 64);
/// let mut cache = PagedKvCache::new(layers, 64, 16, hkv, d, DType::F32, &dev)?;
/// let (a, b) = (cache.add_sequence(), cache.add_sequence());
///
/// // Prefill 5 and 12 tokens, then decode one token for each: the same calls every step.
/// for new in [[5, 12], [1, 1]] {
///     let batch = cache.step(&[(a, new[0]), (b, new[1])])?;
///     let t = batch.num_tokens(); // batch.positions: each new token's position, for RoPE
///     let out = Tensor::zeros((t, hq, d), DType::F32, &dev)?; // once per step, for every layer
///     for layer in 0..layers {
///         // In a model: the layer's projections of the step's hidden states, RoPE applied.
///         let q = Tensor::randn(0f32, 1.0, (t, hq, d), &dev)?;
///         let k = Tensor::randn(0f32, 1.0, (t, hkv, d), &dev)?;
///         let v = Tensor::randn(0f32, 1.0, (t, hkv, d), &dev)?;
///         cache.append(layer, &k, &v, &batch)?;
///         let attn = batch.attn().causal(true);
///         attn.forward_into(&q, cache.k_cache(layer), cache.v_cache(layer), &out, None)?;
///     }
/// }
/// assert_eq!((cache.seq_len(a), cache.seq_len(b)), (Some(6), Some(13)));
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct PagedKvCache {
    block_size: usize,
    num_blocks: usize,
    layers: Vec<(cc::Tensor, cc::Tensor)>,
    free: Vec<i32>,
    seqs: Vec<Option<SeqBlocks>>,
}

impl PagedKvCache {
    /// `num_layers` pairs of zeroed caches `[num_blocks, block_size, hkv, d]` of `dtype` on `device`.
    pub fn new(
        num_layers: usize,
        num_blocks: usize,
        block_size: usize,
        hkv: usize,
        d: usize,
        dtype: cc::DType,
        device: &cc::Device,
    ) -> Result<Self> {
        kit_dtype("dtype", dtype)?;
        if block_size == 0 {
            return Err(Error::value("block_size", 0, "must be >= 1"));
        }
        if num_blocks > i32::MAX as usize || num_blocks.saturating_mul(block_size) > i64::MAX as usize {
            return Err(Error::value("num_blocks", num_blocks, "block indices are i32"));
        }
        let mut layers = Vec::with_capacity(num_layers);
        for _ in 0..num_layers {
            let z = || cc::Tensor::zeros((num_blocks, block_size, hkv, d), dtype, device).map_err(from_candle);
            layers.push((z()?, z()?));
        }
        // Pop from the end: hand out block 0 first.
        let free = (0..num_blocks as i32).rev().collect();
        Ok(PagedKvCache { block_size, num_blocks, layers, free, seqs: Vec::new() })
    }
    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }
    /// Blocks not held by any sequence.
    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }
    /// Layers.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }
    /// The key cache of `layer`.
    pub fn k_cache(&self, layer: usize) -> &cc::Tensor {
        &self.layers[layer].0
    }
    /// The value cache of `layer`.
    pub fn v_cache(&self, layer: usize) -> &cc::Tensor {
        &self.layers[layer].1
    }
    /// A new, empty sequence; its id.
    pub fn add_sequence(&mut self) -> usize {
        if let Some(i) = self.seqs.iter().position(Option::is_none) {
            self.seqs[i] = Some(SeqBlocks::default());
            return i;
        }
        self.seqs.push(Some(SeqBlocks::default()));
        self.seqs.len() - 1
    }
    /// Tokens cached for sequence `id` (`None` for an unknown id).
    pub fn seq_len(&self, id: usize) -> Option<usize> {
        self.seqs.get(id)?.as_ref().map(|s| s.len)
    }
    /// Drop sequence `id` and return its blocks to the free list.
    pub fn free_sequence(&mut self, id: usize) -> Result<()> {
        let s = self.seqs.get_mut(id).and_then(Option::take).ok_or_else(|| unknown(id))?;
        self.free.extend(s.blocks.into_iter().rev());
        Ok(())
    }

    /// Reserve slots for `n` new tokens of each `(sequence id, n)` and return the step's
    /// metadata: the queries of the paged call are the new tokens, in this order. On error
    /// (unknown or repeated id, out of blocks) nothing changes.
    pub fn step(&mut self, batch: &[(usize, usize)]) -> Result<PagedBatch> {
        let mut need = 0usize;
        for (i, &(id, n)) in batch.iter().enumerate() {
            let s = self.seqs.get(id).and_then(Option::as_ref).ok_or_else(|| unknown(id))?;
            if batch[..i].iter().any(|&(other, _)| other == id) {
                return Err(Error::value(format!("batch[{i}].0"), id, "a sequence may appear once per step"));
            }
            need += (s.len + n).div_ceil(self.block_size) - s.blocks.len();
        }
        if need > self.free.len() {
            return Err(Error::value(
                "batch",
                format!("{need} new blocks"),
                format!("only {} of {} blocks are free", self.free.len(), self.num_blocks),
            ));
        }
        let bs = self.block_size;
        let mut out = PagedBatch { cu_seqlens_q: vec![0], ..Default::default() };
        for &(id, n) in batch {
            let s = self.seqs[id].as_mut().ok_or_else(|| unknown(id))?;
            while s.blocks.len() < (s.len + n).div_ceil(bs) {
                s.blocks.push(self.free.pop().ok_or_else(|| unknown(id))?);
            }
            for p in s.len..s.len + n {
                out.slot_mapping.push(s.blocks[p / bs] as i64 * bs as i64 + (p % bs) as i64);
                out.positions.push(p as u32);
            }
            s.len += n;
            out.cu_seqlens_q.push(out.cu_seqlens_q[out.cu_seqlens_q.len() - 1] + n as i32);
            out.seq_lens.push(s.len as i32);
        }
        out.max_blocks =
            batch.iter().filter_map(|&(id, _)| self.seqs[id].as_ref()).map(|s| s.blocks.len()).max().unwrap_or(0);
        out.block_table = vec![0; batch.len() * out.max_blocks];
        for (b, &(id, _)) in batch.iter().enumerate() {
            if let Some(s) = &self.seqs[id] {
                out.block_table[b * out.max_blocks..][..s.blocks.len()].copy_from_slice(&s.blocks);
            }
        }
        Ok(out)
    }

    /// Write a step's new keys and values `[Tq, Hkv, D]` of `layer` into its caches, token `t` at
    /// `batch.slot_mapping[t]`.
    pub fn append(&self, layer: usize, k: &cc::Tensor, v: &cc::Tensor, batch: &PagedBatch) -> Result<()> {
        let (kc, vc) = self
            .layers
            .get(layer)
            .ok_or_else(|| Error::value("layer", layer, format!("the cache has {} layers", self.layers.len())))?;
        reshape_and_cache(k, v, kc, vc, &batch.slot_mapping)
    }
}

fn unknown(id: usize) -> Error {
    Error::value("sequence id", id, "no such sequence in the cache")
}

/// vLLM's `reshape_and_cache`: write `key[t]` and `value[t]` (`[T, Hkv, D]`) into row
/// `slot_mapping[t]` of `k_cache` and `v_cache` (`[num_blocks, block_size, Hkv, D]` seen as
/// `[num_blocks * block_size, Hkv, D]`); a slot of -1 skips the token (padding). Every argument is
/// checked before either cache is written.
pub fn reshape_and_cache(
    key: &cc::Tensor,
    value: &cc::Tensor,
    k_cache: &cc::Tensor,
    v_cache: &cc::Tensor,
    slot_mapping: &[i64],
) -> Result<()> {
    for (arg, t) in [("key", key), ("value", value), ("k_cache", k_cache), ("v_cache", v_cache)] {
        check_device(arg, t, k_cache)?;
        if kit_dtype(arg, t.dtype())? == DType::I32 {
            return Err(Error::value(arg, "dtype i32", "a KV cache holds f32, f16 or bf16"));
        }
    }
    let kd = key.dims();
    let cd = k_cache.dims();
    if cd.len() != 4 {
        return Err(Error::Shape {
            arg: "k_cache",
            got: cd.to_vec(),
            expected: "[num_blocks, block_size, Hkv, D]".into(),
        });
    }
    if v_cache.dims() != cd {
        return Err(Error::Shape {
            arg: "v_cache",
            got: v_cache.dims().to_vec(),
            expected: format!("{cd:?} (the shape of k_cache)"),
        });
    }
    if kd.len() != 3 || kd[1..] != cd[2..] {
        return Err(Error::Shape {
            arg: "key",
            got: kd.to_vec(),
            expected: format!("[T, {}, {}] (Hkv, D of the cache)", cd[2], cd[3]),
        });
    }
    if value.dims() != kd {
        return Err(Error::Shape {
            arg: "value",
            got: value.dims().to_vec(),
            expected: format!("{kd:?} (the shape of key)"),
        });
    }
    for (arg, t) in [("key", key), ("value", value), ("v_cache", v_cache)] {
        if t.dtype() != k_cache.dtype() {
            return Err(Error::value(
                arg,
                format!("dtype {}", t.dtype().as_str()),
                format!("must be {} (the dtype of k_cache)", k_cache.dtype().as_str()),
            ));
        }
    }
    if slot_mapping.len() != kd[0] {
        return Err(Error::value(
            "slot_mapping.len()",
            slot_mapping.len(),
            format!("must be T = {} (tokens of key)", kd[0]),
        ));
    }
    let rows = (cd[0] * cd[1]) as i64;
    if let Some((t, s)) = slot_mapping.iter().enumerate().find(|(_, &s)| s < -1 || s >= rows) {
        return Err(Error::value(
            format!("slot_mapping[{t}]"),
            s,
            format!("must be -1 or in 0..{rows} (num_blocks * block_size)"),
        ));
    }
    for (cache, name) in [(k_cache, "k_cache"), (v_cache, "v_cache")] {
        check_buffer(name, cache)?;
        for (arg, t) in [("key", key), ("value", value)] {
            if same_storage(cache, t) {
                return Err(super::alias(name, arg));
            }
        }
    }
    if same_storage(k_cache, v_cache) {
        return Err(super::alias("v_cache", "k_cache"));
    }
    if slot_mapping.is_empty() {
        return Ok(());
    }
    let (key, value) = (contiguous(key)?, contiguous(value)?);
    let op = Scatter { slots: slot_mapping, row: cd[2] * cd[3], rows: cd[0] * cd[1] };
    k_cache.inplace_op2(&key, &op).map_err(from_candle)?;
    v_cache.inplace_op2(&value, &op).map_err(from_candle)
}

/// Copy row `t` of the source to row `slots[t]` of the destination.
struct Scatter<'a> {
    slots: &'a [i64],
    /// Elements per slot (`Hkv * D`).
    row: usize,
    /// Slots in the cache.
    rows: usize,
}

impl Scatter<'_> {
    fn run<T: Elem>(&self, dst: &mut CpuStorage, dl: &cc::Layout, src: &CpuStorage, sl: &cc::Layout) -> cc::Result<()> {
        let (dr, sr) = (range("cache", dl)?, range("key", sl)?);
        let src = T::of(src).and_then(|s| s.get(sr)).ok_or_else(|| cc::Error::Msg("source storage mismatch".into()))?;
        let dst = T::of_mut(dst)
            .and_then(|s| s.get_mut(dr))
            .ok_or_else(|| cc::Error::Msg("cache storage mismatch".into()))?;
        let r = self.row;
        if src.len() != self.slots.len() * r || dst.len() != self.rows * r {
            return Err(cc::Error::Msg("reshape_and_cache: shapes changed after validation".into()));
        }
        for (t, &s) in self.slots.iter().enumerate() {
            if s >= 0 {
                let s = s as usize;
                dst[s * r..(s + 1) * r].copy_from_slice(&src[t * r..(t + 1) * r]);
            }
        }
        Ok(())
    }
}

impl InplaceOp2 for Scatter<'_> {
    fn name(&self) -> &'static str {
        "attnkit-reshape-and-cache"
    }
    fn cpu_fwd(&self, dst: &mut CpuStorage, dl: &cc::Layout, src: &CpuStorage, sl: &cc::Layout) -> cc::Result<()> {
        match dst.dtype() {
            cc::DType::F32 => self.run::<f32>(dst, dl, src, sl),
            cc::DType::F16 => self.run::<half::f16>(dst, dl, src, sl),
            cc::DType::BF16 => self.run::<half::bf16>(dst, dl, src, sl),
            other => Err(cc::Error::Msg(format!("reshape_and_cache: dtype {} not taken", other.as_str()))),
        }
    }
    #[cfg(feature = "candle-cuda")]
    fn cuda_fwd(
        &self,
        dst: &mut candle_core::CudaStorage,
        dl: &cc::Layout,
        src: &candle_core::CudaStorage,
        sl: &cc::Layout,
    ) -> cc::Result<()> {
        super::cuda::scatter_rows(self.slots, self.row, self.rows, dst, dl, src, sl)
    }
}
