//! CUDA tensors (feature `candle-cuda`): candle's device memory handed to attnkit's `cuda` backend
//! by address, on candle's own stream. Nothing is copied and nothing waits for the device: the
//! attention is queued after candle's earlier work on that stream and before its later work.

use std::cell::RefCell;
use std::sync::{Arc, Mutex};
use std::thread::ThreadId;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::{CudaDevice, CudaStorageSlice, DeviceId};
use candle_core::{self as cc, CudaStorage, InplaceOp1, Shape};
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, SyncOnDrop};

use super::{desc, layout_desc, range, AttnOp, Desc, IntoOp, On};
use crate::cuda::{CudaBackend, DevicePtrs};
use crate::error::{Error, Result};
use crate::validate::Checked;

/// One backend per candle CUDA device and calling thread, made on first use and kept for the
/// process: it holds the metadata mirror and the split-KV workspace (the compiled kernels are
/// shared by every backend of a context), so a warm call allocates nothing. Per thread, because
/// candle's default CUDA device runs on the per-thread default stream: two threads using one
/// candle device run on two streams, and a backend's metadata and workspace buffers must not be
/// shared between streams. Each entry keeps its stream (and so the context) alive.
type Registry = Vec<(DeviceId, ThreadId, Arc<CudaBackend>)>;
static BACKENDS: Mutex<Registry> = Mutex::new(Vec::new());

/// attnkit's `cuda` backend on `dev`'s stream, for this thread.
pub(super) fn backend(dev: &CudaDevice) -> Result<Arc<CudaBackend>> {
    let poisoned = || Error::Backend { backend: "cuda", msg: "backend registry lock poisoned".into() };
    let me = std::thread::current().id();
    let mut list = BACKENDS.lock().map_err(|_| poisoned())?;
    if let Some((_, _, b)) = list.iter().find(|(id, t, _)| *id == dev.id() && *t == me) {
        return Ok(b.clone());
    }
    let b = Arc::new(CudaBackend::on_stream(dev.cuda_stream())?);
    list.push((dev.id(), me, b.clone()));
    Ok(b)
}

fn backend_c(dev: &CudaDevice) -> cc::Result<Arc<CudaBackend>> {
    backend(dev).map_err(cc::Error::wrap)
}

/// Bytes per element of a storage attnkit reads, or a typed error naming the argument.
fn elem_bytes(arg: &'static str, s: &CudaStorageSlice) -> cc::Result<(usize, usize)> {
    match s {
        CudaStorageSlice::F32(x) => Ok((4, x.len())),
        CudaStorageSlice::F16(x) => Ok((2, x.len())),
        CudaStorageSlice::BF16(x) => Ok((2, x.len())),
        _ => Err(Error::value(arg, "another dtype", "must be f32, f16 or bf16").into()),
    }
}

/// Byte offset of the elements `l` names in `s` (contiguous, inside the allocation).
fn byte_offset(arg: &'static str, s: &CudaStorageSlice, l: &cc::Layout) -> cc::Result<u64> {
    let r = range(arg, l)?;
    let (size, len) = elem_bytes(arg, s)?;
    if r.end > len {
        return Err(cc::Error::Msg(format!("`{arg}`: layout {r:?} outside its storage of {len}")));
    }
    Ok((r.start * size) as u64)
}

/// The device address of the elements `l` names in `s`, with the guard that orders the read on
/// `stream`.
fn src_ptr<'a>(
    arg: &'static str,
    s: &'a CudaStorage,
    l: &cc::Layout,
    stream: &'a CudaStream,
) -> cc::Result<(u64, SyncOnDrop<'a>)> {
    let off = byte_offset(arg, &s.slice, l)?;
    let (base, guard) = match &s.slice {
        CudaStorageSlice::F32(x) => x.device_ptr(stream),
        CudaStorageSlice::F16(x) => x.device_ptr(stream),
        CudaStorageSlice::BF16(x) => x.device_ptr(stream),
        _ => unreachable!("elem_bytes admitted f32, f16, bf16 only"),
    };
    Ok((base + off, guard))
}

/// As [`src_ptr`], for a destination.
fn dst_ptr<'a>(
    arg: &'static str,
    s: &'a mut CudaStorage,
    l: &cc::Layout,
    stream: &'a CudaStream,
) -> cc::Result<(u64, SyncOnDrop<'a>)> {
    let off = byte_offset(arg, &s.slice, l)?;
    let (base, guard) = match &mut s.slice {
        CudaStorageSlice::F32(x) => x.device_ptr_mut(stream),
        CudaStorageSlice::F16(x) => x.device_ptr_mut(stream),
        CudaStorageSlice::BF16(x) => x.device_ptr_mut(stream),
        _ => unreachable!("elem_bytes admitted f32, f16, bf16 only"),
    };
    Ok((base + off, guard))
}

type Srcs<'s> = [(&'s CudaStorage, &'s cc::Layout); 3];

fn descs<'l>(names: [&'static str; 3], s: &Srcs<'l>) -> cc::Result<[Desc<'l>; 3]> {
    Ok([
        layout_desc(names[0], s[0].1, s[0].0.dtype())?,
        layout_desc(names[1], s[1].1, s[1].0.dtype())?,
        layout_desc(names[2], s[2].1, s[2].0.dtype())?,
    ])
}

/// Launch `c` on `be` with `q`, `k`, `v` from `s` and the given outputs.
fn launch(
    be: &CudaBackend,
    c: &Checked<'_>,
    names: [&'static str; 3],
    s: &Srcs<'_>,
    out: u64,
    lse: u64,
) -> cc::Result<()> {
    let stream = be.stream();
    let (q, _gq) = src_ptr(names[0], s[0].0, s[0].1, stream)?;
    let (k, _gk) = src_ptr(names[1], s[1].0, s[1].1, stream)?;
    let (v, _gv) = src_ptr(names[2], s[2].0, s[2].1, stream)?;
    // The kernels read and write 16-byte vectors; a fault would poison the whole context, so a
    // misaligned address (which the glue's checks rule out) is an error here, before the launch.
    for (arg, p, a) in [(names[0], q, 16), (names[1], k, 16), (names[2], v, 16), ("out", out, 16), ("lse", lse, 4)] {
        if p % a != 0 {
            return Err(Error::value(arg, format!("device address {p:#x}"), format!("must be {a}-byte aligned")).into());
        }
    }
    // SAFETY: `q`, `k`, `v` address the contiguous elements their validated layouts name, inside
    // their candle allocations (checked above), on the context of candle's stream, which is the
    // backend's. `out` and `lse` are allocations the callers own and checked: they share storage
    // with no input and with each other. Candle frees storage in stream order, after this work.
    unsafe { be.launch(c, DevicePtrs { q, k, v, out, lse }) }.map_err(cc::Error::wrap)
}

/// A fresh allocation of `n` elements of `dtype`, written in full by `write` (which gets its
/// address) before anything else can read it.
fn alloc_written(
    dev: &CudaDevice,
    dtype: cc::DType,
    n: usize,
    write: impl FnOnce(u64) -> cc::Result<()>,
) -> cc::Result<CudaStorage> {
    let stream = dev.cuda_stream();
    // The allocation is never empty (a call with no query rows writes nothing).
    let n = n.max(1);
    macro_rules! go {
        ($t:ty) => {{
            // SAFETY: uninitialised device memory; the kernel writes every element of the output
            // (masked rows included) before candle can read it, in stream order.
            let mut buf = unsafe { dev.alloc::<$t>(n) }?;
            {
                let (p, _g) = buf.device_ptr_mut(&stream);
                write(p)?;
            }
            Ok(CudaStorage::wrap_cuda_slice(buf, dev.clone()))
        }};
    }
    match dtype {
        cc::DType::F32 => go!(f32),
        cc::DType::F16 => go!(half::f16),
        cc::DType::BF16 => go!(half::bf16),
        other => Err(Error::value("q", format!("dtype {}", other.as_str()), "must be f32, f16 or bf16").into()),
    }
}

/// [`AttnOp`] on CUDA storage: the output (and lse) allocated on candle's device.
pub(super) fn alloc_fwd(op: &AttnOp<'_>, s: Srcs<'_>) -> cc::Result<(CudaStorage, Shape)> {
    let dev = &s[0].0.device;
    let be = backend_c(dev)?;
    let names = op.attn.names();
    let d = descs(names, &s)?;
    let r = op.attn.check(On::Cuda(&be), d[0], d[1], d[2], None, None, op.want_lse, |c| -> cc::Result<_> {
        let n = s[0].1.shape().elem_count();
        if !op.want_lse {
            let out = alloc_written(dev, s[0].0.dtype(), n, |o| launch(&be, c, names, &s, o, 0))?;
            return Ok((out, None));
        }
        let mut out = None;
        // The lse is allocated first and the output inside it, so one launch writes both.
        let lse = alloc_written(dev, cc::DType::F32, c.hq * c.total_q, |l| {
            out = Some(alloc_written(dev, s[0].0.dtype(), n, |o| launch(&be, c, names, &s, o, l))?);
            Ok(())
        })?;
        let out = out.ok_or_else(|| cc::Error::Msg("output not allocated".into()))?;
        Ok((out, Some((lse, c.lse_shape_vec()))))
    })?;
    let (out, lse) = r?;
    if let Some((l, shape)) = lse {
        op.keep_lse(cc::Storage::Cuda(l), shape)?;
    }
    Ok((out, s[0].1.shape().clone()))
}

/// [`IntoOp`] on CUDA storage: writes `dst` (and the lse tensor, through a nested in-place op).
pub(super) fn into_fwd(op: &IntoOp<'_>, dst: &mut CudaStorage, dl: &cc::Layout, s: Srcs<'_>) -> cc::Result<()> {
    let be = backend_c(&dst.device)?;
    let names = op.attn.names();
    let d = descs(names, &s)?;
    let out_desc = layout_desc("out", dl, dst.dtype())?;
    let stream = be.stream().clone();
    let (out, _go) = dst_ptr("out", dst, dl, &stream)?;
    match op.lse {
        None => op.attn.check(On::Cuda(&be), d[0], d[1], d[2], Some(out_desc), None, false, |c| {
            launch(&be, c, names, &s, out, 0)
        })?,
        Some(lse_t) => {
            let lse_desc = desc("lse", lse_t)?;
            let attn = op.attn;
            let be = &be;
            let s = &s;
            let stage = LseStage {
                f: RefCell::new(Some(move |lse_s: &mut CudaStorage, ll: &cc::Layout| -> cc::Result<()> {
                    let (lse, _gl) = dst_ptr("lse", lse_s, ll, be.stream())?;
                    attn.check(On::Cuda(be), d[0], d[1], d[2], Some(out_desc), Some(lse_desc), true, |c| {
                        launch(be, c, names, s, out, lse)
                    })?
                })),
            };
            lse_t.inplace_op1(&stage)
        }
    }
}

/// Hands the lse tensor's CUDA memory to the launch of an [`IntoOp`].
struct LseStage<F> {
    f: RefCell<Option<F>>,
}

impl<F: FnOnce(&mut CudaStorage, &cc::Layout) -> cc::Result<()>> InplaceOp1 for LseStage<F> {
    fn name(&self) -> &'static str {
        "attnkit-attention-lse"
    }
    fn cpu_fwd(&self, _: &mut candle_core::CpuStorage, _: &cc::Layout) -> cc::Result<()> {
        Err(Error::value("lse", "a CPU tensor", "must be on the device of `q` (CUDA)").into())
    }
    fn cuda_fwd(&self, storage: &mut CudaStorage, layout: &cc::Layout) -> cc::Result<()> {
        if storage.dtype() != cc::DType::F32 {
            return Err(Error::value("lse", format!("dtype {}", storage.dtype().as_str()), "must be f32").into());
        }
        let f = self.f.borrow_mut().take().ok_or_else(|| cc::Error::Msg("lse stage ran twice".into()))?;
        f(storage, layout)
    }
}

/// `reshape_and_cache` on CUDA storage: row `t` of `src` to row `slots[t]` of `dst` (`row`
/// elements each; `dst` holds `rows` rows), as device-to-device copies on the cache's stream, one
/// per run of consecutive tokens going to consecutive slots (a run per sequence and block).
pub(super) fn scatter_rows(
    slots: &[i64],
    row: usize,
    rows: usize,
    dst: &mut CudaStorage,
    dl: &cc::Layout,
    src: &CudaStorage,
    sl: &cc::Layout,
) -> cc::Result<()> {
    if dst.dtype() != src.dtype() {
        return Err(cc::Error::Msg("reshape_and_cache: dtypes changed after validation".into()));
    }
    let (size, _) = elem_bytes("key", &src.slice)?;
    let (dn, sn) = (range("cache", dl)?.len(), range("key", sl)?.len());
    if sn != slots.len() * row || dn != rows * row {
        return Err(cc::Error::Msg("reshape_and_cache: shapes changed after validation".into()));
    }
    let stream = dst.device.cuda_stream();
    let (d0, _gd) = dst_ptr("cache", dst, dl, &stream)?;
    let (s0, _gs) = src_ptr("key", src, sl, &stream)?;
    let row_bytes = row * size;
    let mut t = 0;
    while t < slots.len() {
        let first = slots[t];
        let mut n = 1;
        while t + n < slots.len() && first >= 0 && slots[t + n] == first + n as i64 {
            n += 1;
        }
        if first >= 0 {
            let (dst_at, src_at) = (d0 + (first as usize * row_bytes) as u64, s0 + (t * row_bytes) as u64);
            // SAFETY: slots were checked to lie in 0..rows and the run in `t..t+n` within the
            // source's rows (lengths checked above against the validated shapes); both pointers
            // are live allocations on this stream's context, and the cache shares no storage
            // with the source (checked before the op ran).
            unsafe { cudarc::driver::result::memcpy_dtod_async(dst_at, src_at, n * row_bytes, stream.cu_stream()) }
                .map_err(|e| cc::Error::Msg(format!("reshape_and_cache: copy: {e}")))?;
        }
        t += n;
    }
    Ok(())
}
