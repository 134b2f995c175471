//! attnkit as the attention of a candle model (feature `candle`).
//!
//! [`Attn`] describes one call of the contract on [`candle_core::Tensor`]s: the layout (dense,
//! varlen or paged, with its metadata as host slices, as in [`Layout`]), the mask and score
//! parameters, and ALiBi slopes. It runs in two forms:
//!
//! - allocating: [`Attn::forward`] (and [`Attn::forward_lse`]) apply [`AttnOp`], a
//!   [`CustomOp3`] over `q`, `k`, `v` that returns `out` (the lse is handed back by the op);
//! - caller buffer: [`Attn::forward_into`] writes into a tensor the model preallocated (and an
//!   optional lse tensor) through an [`InplaceOp3`]; nothing else is allocated for the result.
//!   An output that shares storage with an input (or with the other output) is rejected with an
//!   [`Error`] before anything runs.
//!
//! ## Layouts
//! Inputs must be row-major contiguous in candle's sense; a start offset is fine (a `narrow` on
//! the first dimension costs nothing). Non-contiguous inputs (a transposed view, a column slice of
//! a fused QKV projection) are made contiguous explicitly with [`candle_core::Tensor::contiguous`],
//! one copy by candle; contiguous inputs are read where they are. Output buffers must be
//! contiguous: writing into a copy would not be writing into the caller's buffer, so a
//! non-contiguous `out` or `lse` is an error.
//!
//! ## Devices
//! CPU tensors run attnkit's `cpu` backend directly on candle's memory (f32, f16, bf16): no copy
//! in, no copy out. With the `candle-cuda` feature (candle-core's own `cuda` feature: nvcc at
//! build time for candle's kernels, see `scripts/cuda-toolkit.sh`), CUDA tensors run attnkit's
//! `cuda` backend on the device's candle stream: the kernels read candle's device memory by
//! address and write the output (or the caller's buffer) in place, ordered with candle's other
//! work on that stream; nothing is copied and nothing waits for the device. One backend per candle
//! device is made on first use and kept (compiled kernels, metadata mirror, split-KV workspace).
//! All tensors of a call must be on `q`'s device; another device is an [`Error`] naming the
//! argument, before anything runs.
//!
//! ```
//! use attnkit::candle::Attn;
//! use candle_core::{DType, Device, Tensor};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let dev = Device::Cpu;
//! let q = Tensor::randn(0f32, 1.0, (1, 16, 8, 64), &dev)?;
//! let k = Tensor::randn(0f32, 1.0, (1, 16, 2, 64), &dev)?;
//! let v = Tensor::randn(0f32, 1.0, (1, 16, 2, 64), &dev)?;
//! let attn = Attn::dense().causal(true);
//!
//! // Allocating.
//! let out = attn.forward(&q, &k, &v)?;
//! // Into a buffer the model owns: bit-identical.
//! let buf = Tensor::zeros((1, 16, 8, 64), DType::F32, &dev)?;
//! attn.forward_into(&q, &k, &v, &buf, None)?;
//! assert_eq!((out - &buf)?.abs()?.max_all()?.to_scalar::<f32>()?, 0.0);
//! // Aliasing an input is refused.
//! assert!(attn.forward_into(&q, &k, &v, &q, None).is_err());
//! # Ok(())
//! # }
//! ```
//!
//! In a model, `attnkit::Error` converts into `candle_core::Error`, so `?` works in code that
//! returns candle's `Result`. A decoder with a paged KV cache: see [`PagedKvCache`].

mod cache;
#[cfg(feature = "candle-cuda")]
mod cuda;

pub use cache::{reshape_and_cache, PagedBatch, PagedKvCache};

use std::cell::RefCell;
use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::{self as cc, CpuStorage, CustomOp3, DeviceLocation, InplaceOp1, InplaceOp3, Shape};
use half::{bf16, f16};

use crate::backend::AttentionBackend;
use crate::call::{AttnCall, Layout, Params};
use crate::error::{Error, Result};
use crate::types::{DType, Device, HostData, Storage, Tensor};
use crate::validate::{validate, Checked};

/// The backend that runs CPU tensors.
const BACKEND: &str = "cpu";

/// One attention call of the contract on candle tensors: layout with its host metadata, mask and
/// score parameters, ALiBi slopes. `Copy`, cheap to build per layer and step.
#[derive(Clone, Copy, Debug)]
pub struct Attn<'a> {
    /// Layout and its metadata (for the paged layout, `k` and `v` are the caches).
    pub layout: Layout<'a>,
    /// Mask and score parameters.
    pub params: Params,
    /// ALiBi slopes, f32 `[Hq]`.
    pub alibi_slopes: Option<&'a [f32]>,
}

impl<'a> Attn<'a> {
    /// Any layout, default parameters.
    pub fn new(layout: Layout<'a>) -> Self {
        Attn { layout, params: Params::default(), alibi_slopes: None }
    }
    /// Dense: q `[B, Sq, Hq, D]`, k/v `[B, Sk, Hkv, D]`.
    pub fn dense() -> Self {
        Self::new(Layout::Dense)
    }
    /// Varlen: q `[Tq, Hq, D]`, k/v `[Tk, Hkv, D]`, prefix sums `[B+1]`.
    pub fn varlen(cu_seqlens_q: &'a [i32], cu_seqlens_k: &'a [i32]) -> Self {
        Self::new(Layout::Varlen { cu_seqlens_q, cu_seqlens_k })
    }
    /// Paged: q `[Tq, Hq, D]`, k/v caches `[num_blocks, block_size, Hkv, D]`, `block_table`
    /// row-major `[B, max_blocks]`, `seq_lens` `[B]`. [`PagedBatch::attn`] builds one.
    pub fn paged(cu_seqlens_q: &'a [i32], block_table: &'a [i32], max_blocks: usize, seq_lens: &'a [i32]) -> Self {
        Self::new(Layout::Paged { cu_seqlens_q, block_table, max_blocks, seq_lens })
    }
    /// Set the causal mask (bottom-right aligned).
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
    /// Set the score scale (`None`: `1 / sqrt(D)`).
    pub fn scale(mut self, scale: Option<f32>) -> Self {
        self.params.scale = scale;
        self
    }
    /// Set ALiBi slopes (f32 `[Hq]`).
    pub fn alibi(mut self, slopes: Option<&'a [f32]>) -> Self {
        self.alibi_slopes = slopes;
        self
    }

    /// The lse shape of this call for `q`: `[B, Hq, Sq]` dense, `[Hq, Tq]` otherwise. For
    /// preallocating the lse buffer of [`forward_into`](Self::forward_into).
    pub fn lse_shape(&self, q: &cc::Tensor) -> Result<Vec<usize>> {
        let d = q.dims();
        match (&self.layout, d) {
            (Layout::Dense, [b, sq, hq, _]) => Ok(vec![*b, *hq, *sq]),
            (Layout::Dense, _) => Err(Error::Shape { arg: "q", got: d.to_vec(), expected: "[B, Sq, Hq, D]".into() }),
            (_, [tq, hq, _]) => Ok(vec![*hq, *tq]),
            _ => Err(Error::Shape { arg: "q", got: d.to_vec(), expected: "[Tq, Hq, D]".into() }),
        }
    }

    /// The output, allocated by candle (an [`AttnOp`] applied to `q`, `k`, `v`).
    pub fn forward(&self, q: &cc::Tensor, k: &cc::Tensor, v: &cc::Tensor) -> Result<cc::Tensor> {
        Ok(self.run_alloc(q, k, v, false)?.0)
    }

    /// The output and the lse (f32), both allocated.
    pub fn forward_lse(&self, q: &cc::Tensor, k: &cc::Tensor, v: &cc::Tensor) -> Result<(cc::Tensor, cc::Tensor)> {
        let (out, lse) = self.run_alloc(q, k, v, true)?;
        let lse = lse.ok_or_else(|| Error::Backend { backend: "candle", msg: "the op returned no lse".into() })?;
        Ok((out, lse))
    }

    fn run_alloc(
        &self,
        q: &cc::Tensor,
        k: &cc::Tensor,
        v: &cc::Tensor,
        want_lse: bool,
    ) -> Result<(cc::Tensor, Option<cc::Tensor>)> {
        let names = self.names();
        let inputs = [(names[0], q), (names[1], k), (names[2], v)];
        for (arg, t) in inputs {
            check_device(arg, t, q)?;
        }
        // Every bad input gets its typed error here, before candle runs anything.
        let on = On::of(q)?;
        self.check(on.on(), desc(names[0], q)?, desc(names[1], k)?, desc(names[2], v)?, None, None, want_lse, |_| ())?;
        let (q, k, v) = (contiguous(q)?, contiguous(k)?, contiguous(v)?);
        let op = if want_lse { AttnOp::with_lse(*self) } else { AttnOp::new(*self) };
        let out = q.apply_op3_no_bwd(&k, &v, &op).map_err(from_candle)?;
        Ok((out, op.take_lse()))
    }

    /// Write the output into `out` (and the lse into `lse` when given), tensors the caller
    /// allocated: shape, dtype (f32 for lse) and device exactly the contract's, contiguous, and
    /// sharing storage with no input and with each other. On any error nothing is written.
    pub fn forward_into(
        &self,
        q: &cc::Tensor,
        k: &cc::Tensor,
        v: &cc::Tensor,
        out: &cc::Tensor,
        lse: Option<&cc::Tensor>,
    ) -> Result<()> {
        let names = self.names();
        let inputs = [(names[0], q), (names[1], k), (names[2], v)];
        for (arg, t) in inputs.iter().chain([("out", out)].iter()).chain(lse.map(|l| ("lse", l)).iter()) {
            check_device(arg, t, q)?;
        }
        for (arg, t) in inputs {
            if same_storage(out, t) {
                return Err(alias("out", arg));
            }
            if let Some(l) = lse {
                if same_storage(l, t) {
                    return Err(alias("lse", arg));
                }
            }
        }
        if let Some(l) = lse {
            if same_storage(l, out) {
                return Err(alias("lse", "out"));
            }
        }
        check_buffer("out", out)?;
        check_aligned("out", out)?;
        if let Some(l) = lse {
            check_buffer("lse", l)?;
        }
        let lse_desc = lse.map(|l| desc("lse", l)).transpose()?;
        let on = On::of(q)?;
        self.check(
            on.on(),
            desc(names[0], q)?,
            desc(names[1], k)?,
            desc(names[2], v)?,
            Some(desc("out", out)?),
            lse_desc,
            lse.is_some(),
            |_| (),
        )?;
        if out.elem_count() == 0 {
            return Ok(()); // no query rows (so no lse rows either): nothing to write
        }
        let (q, k, v) = (contiguous(q)?, contiguous(k)?, contiguous(v)?);
        // q travels inside the op (an InplaceOp3 has one destination and two sources). Its read
        // guard is taken before candle locks out (write) and k, v (read); out shares no storage
        // with q, so this cannot deadlock, and k or v sharing q's storage is a second read.
        let (q_storage, q_layout) = q.storage_and_layout();
        let op = IntoOp { attn: *self, q: &q_storage, q_layout, lse };
        out.inplace_op3(&k, &v, &op).map_err(from_candle)
    }

    fn names(&self) -> [&'static str; 3] {
        match self.layout {
            Layout::Paged { .. } => ["q", "k_cache", "v_cache"],
            _ => ["q", "k", "v"],
        }
    }

    /// Validate a call given the shapes and dtypes of its tensors and run `f` on it. Validation
    /// reads shapes, dtypes and devices only, so the tensors it sees hold no data: the data stays
    /// in candle's storage.
    #[allow(clippy::too_many_arguments)]
    fn check<R>(
        &self,
        on: On<'_>,
        q: Desc<'_>,
        k: Desc<'_>,
        v: Desc<'_>,
        out: Option<Desc<'_>>,
        lse: Option<Desc<'_>>,
        want_lse: bool,
        f: impl FnOnce(&Checked<'_>) -> R,
    ) -> Result<R> {
        let (tq, tk, tv) = (q.shape_only(), k.shape_only(), v.shape_only());
        let (to, tl) = (out.map(|d| d.shape_only()), lse.map(|d| d.shape_only()));
        let call = AttnCall {
            q: &tq,
            k: &tk,
            v: &tv,
            layout: self.layout,
            alibi_slopes: self.alibi_slopes,
            params: self.params,
            return_lse: want_lse,
        };
        let c = validate(&call, Device::Host, on.name(), to.as_ref(), tl.as_ref())?;
        match on {
            On::Cpu => crate::cpu::CpuBackend::new()?.supports(&c.problem(want_lse))?,
            #[cfg(feature = "candle-cuda")]
            On::Cuda(be) => be.supports(&c.problem(want_lse))?,
            #[cfg(not(feature = "candle-cuda"))]
            On::Never(_) => {}
        }
        Ok(f(&c))
    }
}

/// The backend a call runs on: where its tensors are.
#[derive(Clone, Copy)]
enum On<'b> {
    Cpu,
    #[cfg(feature = "candle-cuda")]
    Cuda(&'b crate::cuda::CudaBackend),
    #[cfg(not(feature = "candle-cuda"))]
    #[allow(dead_code)]
    Never(std::marker::PhantomData<&'b ()>),
}

impl On<'_> {
    fn name(&self) -> &'static str {
        match self {
            On::Cpu => BACKEND,
            #[cfg(feature = "candle-cuda")]
            On::Cuda(_) => "cuda",
            #[cfg(not(feature = "candle-cuda"))]
            On::Never(_) => BACKEND,
        }
    }
    /// The backend of `t`'s device (the CUDA backend on candle's stream for a CUDA tensor).
    fn of(t: &cc::Tensor) -> Result<Holder> {
        match t.device() {
            cc::Device::Cpu => Ok(Holder::Cpu),
            #[cfg(feature = "candle-cuda")]
            cc::Device::Cuda(d) => Ok(Holder::Cuda(cuda::backend(d)?)),
            other => Err(Error::Backend {
                backend: "candle",
                msg: format!("`q` is on {:?}: no attnkit backend for it in this build", other.location()),
            }),
        }
    }
}

/// An owned [`On`].
enum Holder {
    Cpu,
    #[cfg(feature = "candle-cuda")]
    Cuda(std::sync::Arc<crate::cuda::CudaBackend>),
}

impl Holder {
    fn on(&self) -> On<'_> {
        match self {
            Holder::Cpu => On::Cpu,
            #[cfg(feature = "candle-cuda")]
            Holder::Cuda(b) => On::Cuda(b),
        }
    }
}

/// Shape and dtype of one argument.
#[derive(Clone, Copy)]
struct Desc<'t> {
    dims: &'t [usize],
    dtype: DType,
}

impl Desc<'_> {
    fn shape_only(&self) -> Tensor {
        Tensor::from_storage(self.dims, self.dtype, Storage::Host(HostData::zeros(self.dtype, 0)))
    }
}

fn desc<'t>(arg: &'static str, t: &'t cc::Tensor) -> Result<Desc<'t>> {
    Ok(Desc { dims: t.dims(), dtype: kit_dtype(arg, t.dtype())? })
}

fn layout_desc<'t>(arg: &'static str, l: &'t cc::Layout, dtype: cc::DType) -> cc::Result<Desc<'t>> {
    Ok(Desc { dims: l.dims(), dtype: kit_dtype(arg, dtype).map_err(cc::Error::wrap)? })
}

/// attnkit's dtype of a candle dtype, or a typed error naming the argument.
pub fn kit_dtype(arg: &'static str, dtype: cc::DType) -> Result<DType> {
    match dtype {
        cc::DType::F32 => Ok(DType::F32),
        cc::DType::F16 => Ok(DType::F16),
        cc::DType::BF16 => Ok(DType::BF16),
        cc::DType::I32 => Ok(DType::I32),
        other => Err(Error::value(
            arg,
            format!("dtype {}", other.as_str()),
            "attnkit takes f32, f16, bf16 (and i32 metadata)",
        )),
    }
}

/// `t` is on `q`'s device, and on a device this build runs (CPU; CUDA with `candle-cuda`).
fn check_device(arg: &'static str, t: &cc::Tensor, q: &cc::Tensor) -> Result<()> {
    let (loc, want) = (t.device().location(), q.device().location());
    let runs = matches!(loc, DeviceLocation::Cpu)
        || (cfg!(feature = "candle-cuda") && matches!(loc, DeviceLocation::Cuda { .. }));
    if !runs {
        return Err(Error::Backend {
            backend: "candle",
            msg: format!(
                "`{arg}` is on {loc:?}: this build of attnkit's candle glue runs CPU tensors{}",
                if cfg!(feature = "candle-cuda") {
                    " and CUDA tensors"
                } else {
                    " only (CUDA tensors need the `candle-cuda` feature)"
                }
            ),
        });
    }
    if !t.device().same_device(q.device()) {
        return Err(Error::value(
            arg,
            format!("a tensor on {loc:?}"),
            format!("must be on the device of `q` ({want:?}), the same candle device"),
        ));
    }
    Ok(())
}

/// Address of the `Storage` behind a tensor: equal for tensors that share one allocation. The
/// guard is dropped before returning; the `Arc` the tensor holds keeps the address stable.
fn storage_addr(t: &cc::Tensor) -> usize {
    let (s, _) = t.storage_and_layout();
    std::ptr::from_ref::<cc::Storage>(&*s).addr()
}

fn same_storage(a: &cc::Tensor, b: &cc::Tensor) -> bool {
    storage_addr(a) == storage_addr(b)
}

fn alias(buffer: &'static str, input: &'static str) -> Error {
    Error::value(
        buffer,
        format!("a tensor sharing storage with `{input}`"),
        "an output buffer must not alias an input or the other output: pass a separate buffer",
    )
}

fn check_buffer(arg: &'static str, t: &cc::Tensor) -> Result<()> {
    if t.is_contiguous() {
        return Ok(());
    }
    Err(Error::value(
        arg,
        format!("a view with shape {:?} and strides {:?}", t.dims(), t.stride()),
        "an output buffer must be contiguous (writing into a contiguous copy would not write your buffer)",
    ))
}

/// The tensor itself when contiguous (no copy), else a contiguous copy made by candle. On a GPU
/// the kernels also read 16-byte vectors, so a contiguous view that starts off a 16-byte boundary
/// (a `narrow` at an odd row) is copied too.
fn contiguous(t: &cc::Tensor) -> Result<cc::Tensor> {
    let t = t.contiguous().map_err(from_candle)?;
    if t.device().is_cpu() || misalignment(&t) == 0 {
        return Ok(t);
    }
    t.copy().map_err(from_candle)
}

/// Bytes by which a tensor's first element sits past a 16-byte boundary (candle's device
/// allocations are at least 256-byte aligned, so this is its start offset in bytes, mod 16).
fn misalignment(t: &cc::Tensor) -> usize {
    t.layout().start_offset() * t.dtype().size_in_bytes() % 16
}

/// An output buffer on a GPU must start on a 16-byte boundary (the kernels store vectors). Writing
/// into an aligned copy would not write the caller's buffer, so a misaligned one is refused.
fn check_aligned(arg: &'static str, t: &cc::Tensor) -> Result<()> {
    let off = misalignment(t);
    if t.device().is_cpu() || off == 0 {
        return Ok(());
    }
    Err(Error::value(
        arg,
        format!("a view starting {off} bytes past a 16-byte boundary"),
        "a GPU output buffer must start on a 16-byte boundary (a view at a multiple of 16 bytes into its storage)",
    ))
}

fn from_candle(e: cc::Error) -> Error {
    Error::Backend { backend: "candle", msg: e.to_string() }
}

impl From<Error> for cc::Error {
    fn from(e: Error) -> Self {
        cc::Error::wrap(e)
    }
}

/// The exact elements of a contiguous candle layout, or an error: a strided layout is never read
/// as if it were contiguous.
fn range(arg: &'static str, l: &cc::Layout) -> cc::Result<std::ops::Range<usize>> {
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(a..b),
        None => Err(cc::Error::wrap(Error::value(
            arg,
            format!("a view with strides {:?}", l.stride()),
            "must be contiguous: call `.contiguous()` first",
        ))),
    }
}

/// An element type both candle and the cpu kernel take.
trait Elem: Copy + Default + Send + Sync + 'static {
    fn of(s: &CpuStorage) -> Option<&[Self]>;
    fn of_mut(s: &mut CpuStorage) -> Option<&mut [Self]>;
    fn wrap(v: Vec<Self>) -> CpuStorage;
    fn kernel(c: &Checked<'_>, q: &[Self], k: &[Self], v: &[Self], out: &mut [Self], lse: Option<&mut [f32]>);
}

macro_rules! elem {
    ($t:ty, $variant:ident) => {
        impl Elem for $t {
            fn of(s: &CpuStorage) -> Option<&[Self]> {
                match s {
                    CpuStorage::$variant(v) => Some(v),
                    _ => None,
                }
            }
            fn of_mut(s: &mut CpuStorage) -> Option<&mut [Self]> {
                match s {
                    CpuStorage::$variant(v) => Some(v),
                    _ => None,
                }
            }
            fn wrap(v: Vec<Self>) -> CpuStorage {
                CpuStorage::$variant(v)
            }
            fn kernel(c: &Checked<'_>, q: &[Self], k: &[Self], v: &[Self], out: &mut [Self], lse: Option<&mut [f32]>) {
                crate::cpu::run_slices(c, q, k, v, out, lse)
            }
        }
    };
}
elem!(f32, F32);
elem!(f16, F16);
elem!(bf16, BF16);

/// `q`, `k`, `v` of a validated call as slices of their storage, exactly the elements their
/// shapes name.
fn inputs<'s, T: Elem>(names: [&'static str; 3], s: [(&'s CpuStorage, &cc::Layout); 3]) -> cc::Result<[&'s [T]; 3]> {
    let mut r: [&[T]; 3] = [&[]; 3];
    for (i, (st, l)) in s.into_iter().enumerate() {
        let all = T::of(st).ok_or_else(|| cc::Error::Msg(format!("`{}` has dtype {:?}", names[i], st.dtype())))?;
        let want = range(names[i], l)?;
        r[i] = all.get(want.clone()).ok_or_else(|| {
            cc::Error::Msg(format!("`{}`: layout {want:?} outside its storage of {}", names[i], all.len()))
        })?;
    }
    Ok(r)
}

/// The allocating form: a [`CustomOp3`] over `q`, `k`, `v` returning `out` (dtype of q). Built
/// [`with_lse`](Self::with_lse) it also computes the lse, which [`take_lse`](Self::take_lse) hands
/// back after the op ran. Inputs must be contiguous (see the module docs); [`Attn::forward`] makes
/// them so.
pub struct AttnOp<'a> {
    attn: Attn<'a>,
    want_lse: bool,
    lse: Mutex<Option<(cc::Storage, Vec<usize>)>>,
}

impl<'a> AttnOp<'a> {
    /// The op without lse.
    pub fn new(attn: Attn<'a>) -> Self {
        AttnOp { attn, want_lse: false, lse: Mutex::new(None) }
    }
    /// The op that also computes the lse.
    pub fn with_lse(attn: Attn<'a>) -> Self {
        AttnOp { attn, want_lse: true, lse: Mutex::new(None) }
    }
    /// The lse of the last run (f32, on the device of the inputs), once.
    pub fn take_lse(&self) -> Option<cc::Tensor> {
        let (storage, shape) = self.lse.lock().ok()?.take()?;
        Some(cc::Tensor::from_storage(storage, shape, cc::op::BackpropOp::none(), false))
    }

    fn keep_lse(&self, storage: cc::Storage, shape: Vec<usize>) -> cc::Result<()> {
        *self.lse.lock().map_err(|_| cc::Error::Msg("lse slot poisoned".into()))? = Some((storage, shape));
        Ok(())
    }

    fn run<T: Elem>(&self, s: [(&CpuStorage, &cc::Layout); 3]) -> cc::Result<(CpuStorage, Shape)> {
        let names = self.attn.names();
        let [q, k, v] = inputs::<T>(names, s)?;
        let descs = [
            layout_desc(names[0], s[0].1, s[0].0.dtype())?,
            layout_desc(names[1], s[1].1, s[1].0.dtype())?,
            layout_desc(names[2], s[2].1, s[2].0.dtype())?,
        ];
        let (out, lse) = self.attn.check(On::Cpu, descs[0], descs[1], descs[2], None, None, self.want_lse, |c| {
            let mut out = vec![T::default(); q.len()];
            let mut lse = self.want_lse.then(|| (vec![0f32; c.hq * c.total_q], c.lse_shape_vec()));
            T::kernel(c, q, k, v, &mut out, lse.as_mut().map(|(l, _)| l.as_mut_slice()));
            (out, lse)
        })?;
        if let Some((l, shape)) = lse {
            self.keep_lse(cc::Storage::Cpu(CpuStorage::F32(l)), shape)?;
        }
        Ok((T::wrap(out), s[0].1.shape().clone()))
    }
}

impl CustomOp3 for AttnOp<'_> {
    fn name(&self) -> &'static str {
        "attnkit-attention"
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &cc::Layout,
        s2: &CpuStorage,
        l2: &cc::Layout,
        s3: &CpuStorage,
        l3: &cc::Layout,
    ) -> cc::Result<(CpuStorage, Shape)> {
        let s = [(s1, l1), (s2, l2), (s3, l3)];
        match s1.dtype() {
            cc::DType::F32 => self.run::<f32>(s),
            cc::DType::F16 => self.run::<f16>(s),
            cc::DType::BF16 => self.run::<bf16>(s),
            other => Err(Error::value("q", format!("dtype {}", other.as_str()), "must be f32, f16 or bf16").into()),
        }
    }
    #[cfg(feature = "candle-cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &cc::Layout,
        s2: &candle_core::CudaStorage,
        l2: &cc::Layout,
        s3: &candle_core::CudaStorage,
        l3: &cc::Layout,
    ) -> cc::Result<(candle_core::CudaStorage, Shape)> {
        cuda::alloc_fwd(self, [(s1, l1), (s2, l2), (s3, l3)])
    }
}

/// The caller-buffer form: writes `out` in place (the destination of the [`InplaceOp3`]) from
/// `k`, `v` (its sources) and `q` (held by the op), and the lse through a nested
/// [`InplaceOp1`] on the lse tensor.
struct IntoOp<'s> {
    attn: Attn<'s>,
    q: &'s cc::Storage,
    q_layout: &'s cc::Layout,
    lse: Option<&'s cc::Tensor>,
}

impl IntoOp<'_> {
    fn run<T: Elem>(
        &self,
        dst: &mut CpuStorage,
        dl: &cc::Layout,
        q: &CpuStorage,
        s2: (&CpuStorage, &cc::Layout),
        s3: (&CpuStorage, &cc::Layout),
    ) -> cc::Result<()> {
        let names = self.attn.names();
        let s = [(q, self.q_layout), s2, s3];
        let [q, k, v] = inputs::<T>(names, s)?;
        let descs = [
            layout_desc(names[0], s[0].1, s[0].0.dtype())?,
            layout_desc(names[1], s[1].1, s[1].0.dtype())?,
            layout_desc(names[2], s[2].1, s[2].0.dtype())?,
        ];
        let out_desc = layout_desc("out", dl, dst.dtype())?;
        let out_range = range("out", dl)?;
        let out = T::of_mut(dst).ok_or_else(|| cc::Error::Msg("`out` has another dtype than q".into()))?;
        let out_len = out.len();
        let out = out
            .get_mut(out_range.clone())
            .ok_or_else(|| cc::Error::Msg(format!("`out`: layout {out_range:?} outside its storage of {out_len}")))?;
        match self.lse {
            None => self.attn.check(On::Cpu, descs[0], descs[1], descs[2], Some(out_desc), None, false, |c| {
                T::kernel(c, q, k, v, out, None);
            })?,
            Some(lse_t) => {
                let lse_desc = desc("lse", lse_t)?;
                let attn = self.attn;
                let stage = LseStage {
                    f: RefCell::new(Some(Box::new(move |lse: &mut [f32]| {
                        attn.check(On::Cpu, descs[0], descs[1], descs[2], Some(out_desc), Some(lse_desc), true, |c| {
                            T::kernel(c, q, k, v, out, Some(lse));
                        })
                        .map_err(cc::Error::wrap)
                    }))),
                };
                lse_t.inplace_op1(&stage)?;
            }
        }
        Ok(())
    }
}

impl InplaceOp3 for IntoOp<'_> {
    fn name(&self) -> &'static str {
        "attnkit-attention-into"
    }
    fn cpu_fwd(
        &self,
        dst: &mut CpuStorage,
        dl: &cc::Layout,
        s2: &CpuStorage,
        l2: &cc::Layout,
        s3: &CpuStorage,
        l3: &cc::Layout,
    ) -> cc::Result<()> {
        let cc::Storage::Cpu(q) = self.q else {
            return Err(cc::Error::Msg("`q` is not on the CPU".into()));
        };
        match dst.dtype() {
            cc::DType::F32 => self.run::<f32>(dst, dl, q, (s2, l2), (s3, l3)),
            cc::DType::F16 => self.run::<f16>(dst, dl, q, (s2, l2), (s3, l3)),
            cc::DType::BF16 => self.run::<bf16>(dst, dl, q, (s2, l2), (s3, l3)),
            other => Err(Error::value("out", format!("dtype {}", other.as_str()), "must be f32, f16 or bf16").into()),
        }
    }
    #[cfg(feature = "candle-cuda")]
    fn cuda_fwd(
        &self,
        dst: &mut candle_core::CudaStorage,
        dl: &cc::Layout,
        s2: &candle_core::CudaStorage,
        l2: &cc::Layout,
        s3: &candle_core::CudaStorage,
        l3: &cc::Layout,
    ) -> cc::Result<()> {
        let cc::Storage::Cuda(q) = self.q else {
            return Err(cc::Error::Msg("`q` is not on a CUDA device".into()));
        };
        cuda::into_fwd(self, dst, dl, [(q, self.q_layout), (s2, l2), (s3, l3)])
    }
}

type LseFn<'f> = Box<dyn FnOnce(&mut [f32]) -> cc::Result<()> + 'f>;

/// Hands the lse tensor's memory to the kernel run of an [`IntoOp`].
struct LseStage<'f> {
    f: RefCell<Option<LseFn<'f>>>,
}

impl InplaceOp1 for LseStage<'_> {
    fn name(&self) -> &'static str {
        "attnkit-attention-lse"
    }
    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &cc::Layout) -> cc::Result<()> {
        let r = range("lse", layout)?;
        let CpuStorage::F32(all) = storage else {
            return Err(Error::value("lse", format!("dtype {}", storage.dtype().as_str()), "must be f32").into());
        };
        let n = all.len();
        let lse = all.get_mut(r.clone()).ok_or_else(|| cc::Error::Msg(format!("`lse`: {r:?} outside {n}")))?;
        let f = self.f.borrow_mut().take().ok_or_else(|| cc::Error::Msg("lse stage ran twice".into()))?;
        f(lse)
    }
}
