//! One attention call: inputs, layout metadata, parameters; and the problem a backend is asked about.

use crate::types::{DType, Tensor};

/// Masking and score parameters of the contract.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Params {
    /// Bottom-right aligned causal mask.
    pub causal: bool,
    /// Keys at most this far left of the (aligned) query are visible; `None` is unbounded.
    pub window_left: Option<usize>,
    /// Keys at most this far right of the (aligned) query are visible; `None` is unbounded.
    pub window_right: Option<usize>,
    /// `s = softcap * tanh(s / softcap)` when set; must be finite and > 0.
    pub softcap: Option<f32>,
    /// Score scale; `None` is `1 / sqrt(D)`.
    pub scale: Option<f32>,
}

/// Which of the three layouts a call uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LayoutKind {
    /// q `[B, Sq, Hq, D]`, k/v `[B, Sk, Hkv, D]`.
    Dense,
    /// q `[Tq, Hq, D]`, k/v `[Tk, Hkv, D]`, ragged by `cu_seqlens`.
    Varlen,
    /// q `[Tq, Hq, D]`, k/v caches `[num_blocks, block_size, Hkv, D]` through a block table.
    Paged,
}

impl LayoutKind {
    /// `dense`, `varlen` or `paged`.
    pub fn name(self) -> &'static str {
        match self {
            LayoutKind::Dense => "dense",
            LayoutKind::Varlen => "varlen",
            LayoutKind::Paged => "paged",
        }
    }
    /// All three.
    pub const ALL: [LayoutKind; 3] = [LayoutKind::Dense, LayoutKind::Varlen, LayoutKind::Paged];
}

impl std::fmt::Display for LayoutKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Layout metadata. Host slices: they are validated on the host before any kernel runs, and
/// device backends mirror them into their own reusable buffers.
#[derive(Clone, Copy, Debug)]
pub enum Layout<'a> {
    /// Dense batch.
    Dense,
    /// Packed ragged batch.
    Varlen {
        /// `[B+1]` prefix sums of query lengths, first 0, last `Tq`.
        cu_seqlens_q: &'a [i32],
        /// `[B+1]` prefix sums of key lengths, first 0, last `Tk`.
        cu_seqlens_k: &'a [i32],
    },
    /// Paged KV cache.
    Paged {
        /// `[B+1]` prefix sums of query lengths.
        cu_seqlens_q: &'a [i32],
        /// `[B, max_blocks]` row-major block indices.
        block_table: &'a [i32],
        /// Columns of `block_table`.
        max_blocks: usize,
        /// `[B]` kv length of each sequence.
        seq_lens: &'a [i32],
    },
}

impl Layout<'_> {
    /// The layout's kind.
    pub fn kind(&self) -> LayoutKind {
        match self {
            Layout::Dense => LayoutKind::Dense,
            Layout::Varlen { .. } => LayoutKind::Varlen,
            Layout::Paged { .. } => LayoutKind::Paged,
        }
    }
}

/// Everything one `forward` computes over. For the paged layout `k` and `v` are the caches.
#[derive(Clone, Copy, Debug)]
pub struct AttnCall<'a> {
    /// Queries.
    pub q: &'a Tensor,
    /// Keys (or `k_cache`).
    pub k: &'a Tensor,
    /// Values (or `v_cache`).
    pub v: &'a Tensor,
    /// Layout and its metadata.
    pub layout: Layout<'a>,
    /// ALiBi slopes, f32 `[Hq]`.
    pub alibi_slopes: Option<&'a [f32]>,
    /// Mask and score parameters.
    pub params: Params,
    /// When no lse buffer is given, allocate and return one (otherwise lse is not computed).
    pub return_lse: bool,
}

impl<'a> AttnCall<'a> {
    /// A dense call: q `[B, Sq, Hq, D]`, k/v `[B, Sk, Hkv, D]`.
    pub fn dense(q: &'a Tensor, k: &'a Tensor, v: &'a Tensor) -> Self {
        Self::with_layout(q, k, v, Layout::Dense)
    }
    /// A varlen call.
    pub fn varlen(
        q: &'a Tensor,
        k: &'a Tensor,
        v: &'a Tensor,
        cu_seqlens_q: &'a [i32],
        cu_seqlens_k: &'a [i32],
    ) -> Self {
        Self::with_layout(q, k, v, Layout::Varlen { cu_seqlens_q, cu_seqlens_k })
    }
    /// A paged call over `k_cache`/`v_cache` `[num_blocks, block_size, Hkv, D]`.
    pub fn paged(
        q: &'a Tensor,
        k_cache: &'a Tensor,
        v_cache: &'a Tensor,
        cu_seqlens_q: &'a [i32],
        block_table: &'a [i32],
        max_blocks: usize,
        seq_lens: &'a [i32],
    ) -> Self {
        Self::with_layout(q, k_cache, v_cache, Layout::Paged { cu_seqlens_q, block_table, max_blocks, seq_lens })
    }
    /// A call with any layout and default parameters.
    pub fn with_layout(q: &'a Tensor, k: &'a Tensor, v: &'a Tensor, layout: Layout<'a>) -> Self {
        AttnCall { q, k, v, layout, alibi_slopes: None, params: Params::default(), return_lse: false }
    }
    /// Set the causal mask.
    pub fn causal(mut self, causal: bool) -> Self {
        self.params.causal = causal;
        self
    }
    /// Set the sliding window (left, right); `None` is unbounded on that side.
    pub fn window(mut self, left: Option<usize>, right: Option<usize>) -> Self {
        self.params.window_left = left;
        self.params.window_right = right;
        self
    }
    /// Set the softcap.
    pub fn softcap(mut self, softcap: Option<f32>) -> Self {
        self.params.softcap = softcap;
        self
    }
    /// Set the scale.
    pub fn scale(mut self, scale: Option<f32>) -> Self {
        self.params.scale = scale;
        self
    }
    /// Set ALiBi slopes (f32 `[Hq]`).
    pub fn alibi(mut self, slopes: Option<&'a [f32]>) -> Self {
        self.alibi_slopes = slopes;
        self
    }
    /// Allocate and return lse when no lse buffer is given.
    pub fn with_lse(mut self, yes: bool) -> Self {
        self.return_lse = yes;
        self
    }
}

/// What a backend is asked whether it can run: the problem without its data.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Problem {
    /// Input dtype.
    pub dtype: DType,
    /// Head dim.
    pub head_dim: usize,
    /// Layout.
    pub layout: LayoutKind,
    /// Query heads.
    pub num_heads_q: usize,
    /// Key/value heads.
    pub num_heads_kv: usize,
    /// Causal mask used.
    pub causal: bool,
    /// A window is set.
    pub window: bool,
    /// Softcap is set.
    pub softcap: bool,
    /// ALiBi slopes are given.
    pub alibi: bool,
    /// lse is wanted.
    pub lse: bool,
}

impl Problem {
    /// A plain problem: dense, MHA, no mask, no lse.
    pub fn new(dtype: DType, head_dim: usize) -> Problem {
        Problem {
            dtype,
            head_dim,
            layout: LayoutKind::Dense,
            num_heads_q: 1,
            num_heads_kv: 1,
            causal: false,
            window: false,
            softcap: false,
            alibi: false,
            lse: false,
        }
    }
}

/// Which head dims a backend takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeadDims {
    /// Every `D` in `1..=max`.
    UpTo(usize),
    /// Every multiple of `step` in `step..=max`.
    MultipleOf {
        /// The step.
        step: usize,
        /// The largest.
        max: usize,
    },
}

impl HeadDims {
    /// Whether `d` is taken.
    pub fn contains(self, d: usize) -> bool {
        match self {
            HeadDims::UpTo(max) => (1..=max).contains(&d),
            HeadDims::MultipleOf { step, max } => d >= step && d <= max && d.is_multiple_of(step),
        }
    }
    /// Every head dim taken, ascending.
    pub fn iter(self) -> impl Iterator<Item = usize> {
        let (step, max) = match self {
            HeadDims::UpTo(max) => (1, max),
            HeadDims::MultipleOf { step, max } => (step, max),
        };
        (step..=max).step_by(step)
    }
}

impl std::fmt::Display for HeadDims {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HeadDims::UpTo(m) => write!(f, "1..={m}"),
            HeadDims::MultipleOf { step, max } => write!(f, "multiples of {step} up to {max}"),
        }
    }
}

/// What a backend can run. Static per backend instance, so asking allocates nothing.
#[derive(Clone, Debug, PartialEq)]
pub struct Capabilities {
    /// Input dtypes.
    pub dtypes: &'static [DType],
    /// Head dims.
    pub head_dims: HeadDims,
    /// Layouts.
    pub layouts: &'static [LayoutKind],
    /// Causal mask.
    pub causal: bool,
    /// Sliding window.
    pub window: bool,
    /// Softcap.
    pub softcap: bool,
    /// ALiBi.
    pub alibi: bool,
    /// lse output.
    pub lse: bool,
}

impl Capabilities {
    /// The whole contract, for head dims `head_dims`.
    pub const fn full(head_dims: HeadDims) -> Capabilities {
        Capabilities {
            dtypes: &DType::FLOATS,
            head_dims,
            layouts: &LayoutKind::ALL,
            causal: true,
            window: true,
            softcap: true,
            alibi: true,
            lse: true,
        }
    }
    /// `Ok` or every reason why not. Allocates only when it says no.
    pub fn check(&self, backend: &'static str, p: &Problem) -> Result<(), crate::Unsupported> {
        let ok = self.dtypes.contains(&p.dtype)
            && self.head_dims.contains(p.head_dim)
            && self.layouts.contains(&p.layout)
            && (self.causal || !p.causal)
            && (self.window || !p.window)
            && (self.softcap || !p.softcap)
            && (self.alibi || !p.alibi)
            && (self.lse || !p.lse);
        if ok {
            return Ok(());
        }
        let mut reasons = Vec::new();
        if !self.dtypes.contains(&p.dtype) {
            reasons.push(format!("dtype {} is not supported (supported: {:?})", p.dtype, self.dtypes));
        }
        if !self.head_dims.contains(p.head_dim) {
            reasons.push(format!("head dim {} is not supported (supported: {})", p.head_dim, self.head_dims));
        }
        if !self.layouts.contains(&p.layout) {
            reasons.push(format!("layout {} is not supported", p.layout));
        }
        for (want, have, what) in [
            (p.causal, self.causal, "causal"),
            (p.window, self.window, "sliding window"),
            (p.softcap, self.softcap, "softcap"),
            (p.alibi, self.alibi, "alibi"),
            (p.lse, self.lse, "lse output"),
        ] {
            if want && !have {
                reasons.push(format!("{what} is not supported"));
            }
        }
        Err(crate::Unsupported { backend, reasons })
    }
}
