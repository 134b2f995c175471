//! `cuda`: attention kernels of our own, compiled at run time by NVRTC for the device's
//! architecture (no CUDA toolkit at build time: cudarc loads the driver and NVRTC dynamically).
//!
//! - f16/bf16 prefill: a FlashAttention-2-style tensor-core kernel (`kernels/attn_mma.cu`).
//! - decode (at most 8 query rows per kv head): split-KV flash-decoding with an lse combine
//!   (`kernels/attn_decode.cu`, `kernels/attn_combine.cuh`); one CTA reads a K/V row once for
//!   every query head of its group. With a GQA group of 4 or more (f16/bf16) decode runs on the
//!   tensor cores instead: the same kernel as prefill with a one-warp, 16-row tile, split-KV.
//! - f32 prefill: a CUDA-core kernel (`kernels/attn_simt.cu`).
//!
//! Layout metadata arrives as host slices; it is mirrored into one reusable device buffer
//! through pinned staging memory, and copied only when it changed since the last call. With
//! caller buffers and unchanged metadata `forward` allocates nothing, copies nothing and never
//! waits for the device, so it can be captured in a CUDA graph on [`CudaBackend::stream`].

mod kernel;
mod nvrtc;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute, CUstreamCaptureStatus};
use cudarc::driver::{
    result as drv, CudaContext, CudaEvent, CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig,
    PinnedHostSlice,
};
use cudarc::nvrtc::Ptx;

pub use kernel::{all_variants, mma_traits, CudaTuning, KernelKey, MmaTraits, Plan, Variant, DECODE_MAX_ROWS};
pub use nvrtc::{cache_dir, Family};

use crate::backend::AttentionBackend;
use crate::call::{AttnCall, Capabilities, HeadDims, Layout, LayoutKind};
use crate::error::{Error, Result};
use crate::types::{DType, Device, HostData, Storage, Tensor};
use crate::validate::{validate, Checked};
use kernel::KernelParams;

const NAME: &str = "cuda";

/// Largest head dim; every multiple of 8 up to it runs.
pub const MAX_HEAD_DIM: usize = 256;

static CUDA_CAPS: Capabilities = Capabilities::full(HeadDims::MultipleOf { step: 8, max: MAX_HEAD_DIM });

fn be_err(msg: impl std::fmt::Display) -> Error {
    Error::Backend { backend: NAME, msg: msg.to_string() }
}

/// Device memory of the `cuda` backend: a byte buffer on one device.
#[derive(Debug)]
pub struct CudaStorage {
    buf: CudaSlice<u8>,
    bytes: usize,
    device: Device,
}

impl CudaStorage {
    /// The device the memory is on.
    pub fn device(&self) -> Device {
        self.device
    }
    /// The allocation.
    pub fn slice(&self) -> &CudaSlice<u8> {
        &self.buf
    }
    /// Bytes of tensor data (the allocation may be larger).
    pub fn len_bytes(&self) -> usize {
        self.bytes
    }
    fn ptr(&self, stream: &CudaStream) -> u64 {
        let (p, _sync) = self.buf.device_ptr(stream);
        p
    }
}

/// Whether the CUDA driver library can be loaded in this process.
pub fn driver_available() -> bool {
    // With `candle-cuda`, candle-core links cudarc to the CUDA libraries (its `dynamic-linking`),
    // so the process could not have started without them.
    #[cfg(feature = "candle-cuda")]
    return true;
    #[cfg(not(feature = "candle-cuda"))]
    // SAFETY: only tries to open the shared library by its usual names; nothing is called.
    unsafe {
        cudarc::driver::sys::is_culib_present()
    }
}

/// Whether the NVRTC library can be loaded in this process.
pub fn nvrtc_available() -> bool {
    nvrtc::available()
}

/// NVRTC's version, `(major, minor)`.
pub fn nvrtc_version() -> std::result::Result<(i32, i32), String> {
    nvrtc::version()
}

/// Compile one kernel variant for `arch` (`"sm_90"`) with NVRTC, without a device and without the
/// disk cache: CI uses it to check that every kernel compiles. Returns the cubin size.
pub fn compile_variant(v: &Variant, arch: &str) -> std::result::Result<usize, String> {
    nvrtc::compile(v.family, &v.defines, arch).map(|b| b.len())
}

/// What a loaded kernel uses, from the driver: registers per thread, local (spill) bytes per
/// thread, static shared bytes.
#[derive(Clone, Debug)]
pub struct KernelInfo {
    /// The variant's key.
    pub key: String,
    /// Registers per thread.
    pub regs: i32,
    /// Local memory per thread (spills, stack).
    pub local_bytes: i32,
    /// Static shared memory.
    pub static_smem: i32,
    /// Whether the cubin came from the disk cache.
    pub cached: bool,
    /// Milliseconds spent compiling or reading and loading it.
    pub load_ms: f64,
    /// CTAs of the main function one multiprocessor holds at once (the driver's occupancy
    /// calculator, with the launch's block size and dynamic shared memory), 0 if unknown.
    pub ctas_per_sm: usize,
}

struct Loaded {
    funcs: HashMap<&'static str, CudaFunction>,
    info: KernelInfo,
}

/// Metadata mirror and split-KV workspace.
struct State {
    /// The metadata last copied to `meta_dev` (host shadow, to skip unchanged uploads).
    shadow: Vec<i32>,
    /// The metadata of the call in progress, built here so a warm call allocates nothing.
    meta: Vec<i32>,
    staging: Option<PinnedHostSlice<i32>>,
    meta_dev: Option<CudaSlice<i32>>,
    /// Recorded after the last staging copy; waited on before the staging buffer is rewritten.
    copied: Option<CudaEvent>,
    workspace: Option<CudaSlice<f32>>,
}

/// Kernels loaded so far, by context: a module belongs to a context, not to a stream, so
/// backends on several streams of one context (a library's per-thread streams) compile and load
/// each kernel once.
static SHARED_KERNELS: Mutex<Vec<(usize, KernelKey, Arc<Loaded>)>> = Mutex::new(Vec::new());

/// The `cuda` backend: one device, one stream.
pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    ordinal: usize,
    arch: String,
    sms: usize,
    smem_optin: usize,
    kernels: Mutex<HashMap<KernelKey, Arc<Loaded>>>,
    state: Mutex<State>,
    force: Option<String>,
    splits: Option<usize>,
    tuning: CudaTuning,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("ordinal", &self.ordinal)
            .field("arch", &self.arch)
            .field("sms", &self.sms)
            .finish()
    }
}

fn no_device(msg: impl Into<String>) -> Error {
    Error::NoDevice { backend: NAME, msg: msg.into() }
}

impl CudaBackend {
    /// The first CUDA device (`ATTNKIT_CUDA_DEVICE` picks another ordinal).
    pub fn new() -> Result<Self> {
        let ordinal = std::env::var("ATTNKIT_CUDA_DEVICE").ok().and_then(|s| s.parse().ok()).unwrap_or(0);
        Self::on_device(ordinal)
    }

    /// The CUDA device `ordinal`. [`Error::NoDevice`] when the driver, NVRTC or the device is
    /// missing; never panics.
    pub fn on_device(ordinal: usize) -> Result<Self> {
        if !driver_available() {
            return Err(no_device("the CUDA driver library (libcuda) cannot be loaded"));
        }
        if !nvrtc::available() {
            return Err(no_device("the NVRTC library (libnvrtc) cannot be loaded; put its folder on LD_LIBRARY_PATH"));
        }
        let n = CudaContext::device_count().map_err(|e| no_device(format!("cuInit/cuDeviceGetCount: {e}")))?;
        if n <= 0 || ordinal >= n as usize {
            return Err(no_device(format!("device {ordinal} requested, {n} present")));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| no_device(format!("context on device {ordinal}: {e}")))?;
        // SAFETY: called before this backend allocates anything; all its work runs on one stream,
        // so cudarc's cross-stream events are not needed (and would break graph capture).
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(be_err)?;
        Self::build(ctx, stream, ordinal)
    }

    /// A backend that runs every call on `stream`, in its context: another library's stream
    /// (candle's, for instance), so attention is ordered with that library's work and reads its
    /// memory in place. The context's event tracking is left as its owner set it.
    pub fn on_stream(stream: Arc<CudaStream>) -> Result<Self> {
        if !nvrtc::available() {
            return Err(no_device("the NVRTC library (libnvrtc) cannot be loaded; put its folder on LD_LIBRARY_PATH"));
        }
        let ctx = stream.context().clone();
        let ordinal = ctx.ordinal();
        Self::build(ctx, stream, ordinal)
    }

    fn build(ctx: Arc<CudaContext>, stream: Arc<CudaStream>, ordinal: usize) -> Result<Self> {
        let (major, minor) = ctx.compute_capability().map_err(be_err)?;
        let sms = ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).map_err(be_err)? as usize;
        let smem_optin = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .map_err(be_err)? as usize;
        if major < 8 {
            return Err(no_device(format!("compute capability {major}.{minor}: the cuda backend needs 8.0 or newer")));
        }
        let force = std::env::var("ATTNKIT_CUDA_KERNEL").ok().filter(|s| !s.is_empty());
        Ok(CudaBackend {
            ctx,
            stream,
            ordinal,
            arch: format!("sm_{major}{minor}"),
            sms,
            smem_optin,
            kernels: Mutex::new(HashMap::new()),
            state: Mutex::new(State {
                shadow: Vec::new(),
                meta: Vec::new(),
                staging: None,
                meta_dev: None,
                copied: None,
                workspace: None,
            }),
            force,
            splits: None,
            tuning: CudaTuning::from_env(),
        })
    }

    /// Force a kernel where it can run the call: `simt`, `mma` or `decode` (testing and
    /// tuning; `None` restores the planner). `ATTNKIT_CUDA_KERNEL` sets it at construction.
    pub fn set_kernel(&mut self, kernel: Option<&str>) {
        self.force = kernel.map(str::to_string);
    }

    /// Replace the planner's tuning knobs (read from the `ATTNKIT_CUDA_*` environment variables
    /// when the backend was built; see [`CudaTuning`]).
    pub fn set_tuning(&mut self, tuning: CudaTuning) {
        self.tuning = tuning;
    }

    /// The planner's tuning knobs.
    pub fn tuning(&self) -> &CudaTuning {
        &self.tuning
    }

    /// Force the split count of the split-KV kernels (`None`: planned from the problem and the
    /// SM count).
    pub fn set_kv_splits(&mut self, splits: Option<usize>) {
        self.splits = splits.map(|s| s.clamp(1, 64));
    }

    /// The stream every call of this backend runs on (capture it to build a CUDA graph).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
    /// The context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
    /// `sm_90` and so on.
    pub fn arch(&self) -> &str {
        &self.arch
    }
    /// Multiprocessors on the device.
    pub fn sm_count(&self) -> usize {
        self.sms
    }

    /// The kernel plan of a validated call.
    pub fn plan(&self, c: &Checked<'_>) -> Plan {
        // The split count of the one-warp GQA decode tile follows from how many of its CTAs the
        // device holds at once: ask the loaded kernel (compiled here on first use).
        let occupancy = |t: &MmaTraits| {
            let l = self.kernel(&Plan::Mma { t: *t, splits: 1 }, c.dtype).ok()?;
            (l.info.ctas_per_sm > 0).then_some(l.info.ctas_per_sm)
        };
        kernel::plan(c, self.sms, self.arch == "sm_90", self.force.as_deref(), self.splits, &self.tuning, &occupancy)
    }

    /// Bytes of split-KV workspace a call needs (0 for most prefill calls). The backend keeps
    /// its own, grown on demand; size it ahead with [`CudaBackend::reserve_workspace`] before
    /// capturing a graph.
    pub fn workspace_bytes(&self, c: &Checked<'_>) -> usize {
        self.plan(c).workspace_elems(c) * 4
    }

    /// Grow the backend's workspace to at least `bytes`.
    pub fn reserve_workspace(&self, bytes: usize) -> Result<()> {
        let mut st = self.state.lock().map_err(|_| be_err("state lock poisoned"))?;
        self.ensure_workspace(&mut st, bytes.div_ceil(4))
    }

    /// Compile (or load from the cache) every kernel a call needs, without running it.
    pub fn warm_up(&self, c: &Checked<'_>) -> Result<KernelInfo> {
        let plan = self.plan(c);
        Ok(self.kernel(&plan, c.dtype)?.info.clone())
    }

    /// What every kernel loaded so far uses.
    pub fn loaded_kernels(&self) -> Vec<KernelInfo> {
        let k = self.kernels.lock().map(|k| k.values().map(|l| l.info.clone()).collect()).unwrap_or_default();
        let mut k: Vec<KernelInfo> = k;
        k.sort_by(|a, b| a.key.cmp(&b.key));
        k
    }

    /// Device time of `iters` runs of `f` on this backend's stream, in milliseconds per run,
    /// measured with CUDA events (no host clock, no per-run synchronisation).
    pub fn time_ms(&self, iters: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
        let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = self.ctx.new_event(flags).map_err(be_err)?;
        let end = self.ctx.new_event(flags).map_err(be_err)?;
        start.record(&self.stream).map_err(be_err)?;
        for _ in 0..iters.max(1) {
            f()?;
        }
        end.record(&self.stream).map_err(be_err)?;
        end.synchronize().map_err(be_err)?;
        let ms = start.elapsed_ms(&end).map_err(be_err)?;
        Ok(ms as f64 / iters.max(1) as f64)
    }

    fn kernel(&self, plan: &Plan, dtype: DType) -> Result<Arc<Loaded>> {
        let key = plan.kernel_key(dtype);
        let mut map = self.kernels.lock().map_err(|_| be_err("kernel cache lock poisoned"))?;
        if let Some(l) = map.get(&key) {
            return Ok(l.clone());
        }
        // Another backend of this context may have loaded it (backends on several streams).
        let ctx_id = self.ctx.cu_ctx() as usize;
        let shared = SHARED_KERNELS.lock().map_err(|_| be_err("kernel cache lock poisoned"))?;
        if let Some((_, _, l)) = shared.iter().find(|(c, k, _)| *c == ctx_id && *k == key) {
            map.insert(key, l.clone());
            return Ok(l.clone());
        }
        drop(shared);
        let v = &plan.variant(dtype);
        let t0 = std::time::Instant::now();
        let (bin, cached) = nvrtc::cubin(v.family, &v.defines, &self.arch).map_err(be_err)?;
        let module =
            self.ctx.load_module(Ptx::from_binary(bin)).map_err(|e| be_err(format!("loading {}: {e}", v.key())))?;
        let names: &[&'static str] = match v.family {
            Family::Simt => &["attn_simt"],
            Family::Decode => &["attn_decode", "attn_combine"],
            Family::Mma => &["attn_mma", "attn_combine"],
        };
        let mut funcs = HashMap::new();
        for &n in names {
            let f = module.load_function(n).map_err(|e| be_err(format!("{n} in {}: {e}", v.key())))?;
            funcs.insert(n, f);
        }
        // Dynamic shared memory above 48 KiB must be opted into per function.
        let dyn_smem = match v.family {
            Family::Simt => {
                let dmax = v.defines.iter().find(|d| d.0 == "DMAX").map(|d| d.1 as usize).unwrap_or(256);
                simt_smem(dmax)
            }
            Family::Mma => {
                let g = |k: &str| v.defines.iter().find(|d| d.0 == k).map(|d| d.1 as usize).unwrap_or(0);
                let wg = g("WG") == 1;
                let (dpad, bm, bn, nw, bulk) = (g("DPAD"), g("BM"), g("BN"), g("NW"), g("BULK"));
                MmaTraits { dpad, bm, bn, nw, minb: 1, post: false, wg, bulk }.smem_bytes()
            }
            Family::Decode => 0,
        };
        let main = funcs[names[0]].clone();
        // Static and dynamic shared memory together must stay under the default 48 KiB unless
        // the function opts in, so opt in whenever dynamic memory is used.
        if dyn_smem > 0 {
            if dyn_smem > self.smem_optin {
                return Err(be_err(format!(
                    "{} needs {dyn_smem} bytes of shared memory, the device allows {}",
                    v.key(),
                    self.smem_optin
                )));
            }
            main.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, dyn_smem as i32)
                .map_err(be_err)?;
        }
        let threads = match v.family {
            Family::Mma => 32 * v.defines.iter().find(|d| d.0 == "NW").map_or(1, |d| d.1 as usize),
            _ => 128,
        };
        let ctas_per_sm =
            main.occupancy_max_active_blocks_per_multiprocessor(threads as u32, dyn_smem, None).unwrap_or(0);
        let info = KernelInfo {
            ctas_per_sm: ctas_per_sm as usize,
            key: v.key(),
            regs: main.num_regs().unwrap_or(-1),
            local_bytes: main.local_size_bytes().unwrap_or(-1),
            static_smem: main.shared_size_bytes().unwrap_or(-1),
            cached,
            load_ms: t0.elapsed().as_secs_f64() * 1e3,
        };
        let l = Arc::new(Loaded { funcs, info });
        map.insert(key, l.clone());
        if let Ok(mut shared) = SHARED_KERNELS.lock() {
            shared.push((ctx_id, key, l.clone()));
        }
        Ok(l)
    }

    /// Launch `f` with the parameter block as its one argument, straight through the driver (a
    /// launch builder would collect its arguments in a heap vector on every call).
    ///
    /// # Safety
    /// `f` must take exactly one argument of type `KernelParams`' device twin, and every pointer
    /// in `kp` must be valid for what `f` does with it until the launch completes.
    unsafe fn launch_params(&self, f: &CudaFunction, cfg: LaunchConfig, kp: &KernelParams) -> Result<()> {
        let mut args = [std::ptr::from_ref(kp).cast_mut().cast::<std::ffi::c_void>()];
        // SAFETY: the argument array holds one pointer to `kp`, which outlives this call (the
        // driver copies kernel arguments at launch); the rest is the caller's contract.
        unsafe {
            drv::launch_kernel(
                f.cu_function(),
                cfg.grid_dim,
                cfg.block_dim,
                cfg.shared_mem_bytes,
                self.stream.cu_stream(),
                &mut args,
            )
        }
        .map_err(be_err)
    }

    fn capturing(&self) -> Result<bool> {
        let s = self.stream.capture_status().map_err(be_err)?;
        Ok(s != CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    }

    fn ensure_workspace(&self, st: &mut State, elems: usize) -> Result<()> {
        let have = st.workspace.as_ref().map(|w| w.len()).unwrap_or(0);
        if elems <= have {
            return Ok(());
        }
        if self.capturing()? {
            return Err(be_err(format!(
                "split-KV workspace of {} bytes needed during graph capture; call forward once before capturing, or reserve_workspace",
                elems * 4
            )));
        }
        st.workspace = None;
        // SAFETY: the workspace is written by the decode kernel before the combine kernel reads it.
        let w = unsafe { self.stream.alloc::<f32>(elems.max(1024)) }.map_err(be_err)?;
        st.workspace = Some(w);
        Ok(())
    }

    /// Make the device metadata buffer hold `meta`; copy only when it changed.
    fn upload_meta(&self, st: &mut State, meta: &[i32]) -> Result<()> {
        if meta.is_empty() || st.shadow == meta {
            return Ok(());
        }
        if self.capturing()? {
            return Err(be_err(
                "layout metadata changed during graph capture: run the same call once before capturing, so its metadata is on the device",
            ));
        }
        let n = meta.len();
        if st.meta_dev.as_ref().map(|m| m.len()).unwrap_or(0) < n {
            let cap = n.next_power_of_two().max(256);
            if let Some(ev) = st.copied.take() {
                ev.synchronize().map_err(be_err)?;
            }
            st.staging = None;
            st.meta_dev = None;
            // SAFETY: pinned host memory, fully written below before any copy reads it.
            st.staging = Some(unsafe { self.ctx.alloc_pinned::<i32>(cap) }.map_err(be_err)?);
            // SAFETY: written by the copy below before any kernel reads it.
            st.meta_dev = Some(unsafe { self.stream.alloc::<i32>(cap) }.map_err(be_err)?);
        }
        // The previous copy out of the staging buffer must be done before it is overwritten.
        if let Some(ev) = st.copied.as_ref() {
            ev.synchronize().map_err(be_err)?;
        }
        let staging = st.staging.as_mut().ok_or_else(|| be_err("no staging buffer"))?;
        let host = staging.as_mut_slice().map_err(be_err)?;
        host[..n].copy_from_slice(meta);
        let dst = st.meta_dev.as_ref().ok_or_else(|| be_err("no metadata buffer"))?;
        let (dptr, _s) = dst.device_ptr(&self.stream);
        // SAFETY: `dst` holds at least `n` i32; the source is pinned memory that stays alive and
        // is not rewritten until the event recorded below has completed.
        unsafe { drv::memcpy_htod_async(dptr, &host[..n], self.stream.cu_stream()) }.map_err(be_err)?;
        let ev = match st.copied.take() {
            Some(e) => e,
            None => self.ctx.new_event(None).map_err(be_err)?,
        };
        ev.record(&self.stream).map_err(be_err)?;
        st.copied = Some(ev);
        st.shadow.clear();
        st.shadow.extend_from_slice(meta);
        Ok(())
    }

    /// Device addresses of a call's tensors and of `out` (and `lse`), each checked to be this
    /// backend's memory.
    fn device_ptrs(&self, call: &AttnCall<'_>, out: &Tensor, lse: Option<&Tensor>) -> Result<DevicePtrs> {
        let ptr = |arg, t| self.storage(arg, t).map(|s| s.ptr(&self.stream));
        Ok(DevicePtrs {
            q: ptr("q", call.q)?,
            k: ptr("k", call.k)?,
            v: ptr("v", call.v)?,
            out: ptr("out", out)?,
            lse: match lse {
                Some(l) => ptr("lse", l)?,
                None => 0,
            },
        })
    }
    fn storage<'t>(&self, arg: &'static str, t: &'t Tensor) -> Result<&'t CudaStorage> {
        match t.storage() {
            Storage::Cuda(s) => Ok(s),
            #[allow(unreachable_patterns)]
            _ => Err(Error::Device { arg, got: t.device(), expected: self.device(), backend: NAME }),
        }
    }
}

fn simt_smem(dmax: usize) -> usize {
    // Q, K, V tiles of 32 rows of (d + 1) floats, and a 32 x 33 score tile.
    (32 * (dmax + 1) * 3 + 32 * 33) * 4
}

fn simt_smem_for(d: usize) -> usize {
    (32 * (d + 1) * 3 + 32 * 33) * 4
}

fn host_bytes(t: &Tensor) -> Result<Vec<u8>> {
    t.host().map(HostData::to_le_bytes).ok_or_else(|| Error::Device {
        arg: "src",
        got: t.device(),
        expected: Device::Host,
        backend: NAME,
    })
}

impl AttentionBackend for CudaBackend {
    fn name(&self) -> &'static str {
        NAME
    }
    fn device(&self) -> Device {
        Device::Cuda(self.ordinal)
    }
    fn capabilities(&self) -> &Capabilities {
        &CUDA_CAPS
    }
    fn alloc(&self, shape: &[usize], dtype: DType) -> Result<Tensor> {
        let bytes = shape.iter().product::<usize>() * dtype.size();
        let buf = self.stream.alloc_zeros::<u8>(bytes.max(16)).map_err(be_err)?;
        Ok(Tensor::from_storage(shape, dtype, Storage::Cuda(CudaStorage { buf, bytes, device: self.device() })))
    }
    fn upload(&self, t: &Tensor) -> Result<Tensor> {
        let bytes = host_bytes(t)?;
        let mut out = self.alloc(t.shape(), t.dtype())?;
        if !bytes.is_empty() {
            if let Storage::Cuda(s) = out.storage_mut() {
                self.stream.memcpy_htod(&bytes, &mut s.buf).map_err(be_err)?;
            }
        }
        self.stream.synchronize().map_err(be_err)?;
        Ok(out)
    }
    fn download(&self, t: &Tensor) -> Result<Tensor> {
        let s = self.storage("tensor", t)?;
        let mut bytes = vec![0u8; s.bytes];
        if s.bytes > 0 {
            let view = s.buf.slice(0..s.bytes);
            self.stream.memcpy_dtoh(&view, &mut bytes).map_err(be_err)?;
        }
        self.stream.synchronize().map_err(be_err)?;
        let data = HostData::from_le_bytes(t.dtype(), &bytes).ok_or_else(|| be_err("downloaded size mismatch"))?;
        Tensor::from_host(t.shape(), data)
    }
    fn write(&self, dst: &mut Tensor, src: &Tensor) -> Result<()> {
        if dst.shape() != src.shape() || dst.dtype() != src.dtype() {
            return Err(Error::Shape {
                arg: "dst",
                got: dst.shape().to_vec(),
                expected: format!("{:?} {} (the source)", src.shape(), src.dtype()),
            });
        }
        let bytes = host_bytes(src)?;
        let device = self.device();
        let got = dst.device();
        match dst.storage_mut() {
            Storage::Cuda(s) => {
                if !bytes.is_empty() {
                    let mut view = s.buf.slice_mut(0..bytes.len());
                    self.stream.memcpy_htod(&bytes, &mut view).map_err(be_err)?;
                }
            }
            #[allow(unreachable_patterns)]
            _ => return Err(Error::Device { arg: "dst", got, expected: device, backend: NAME }),
        }
        self.stream.synchronize().map_err(be_err)
    }
    fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(be_err)
    }

    fn forward_into(&self, c: &Checked<'_>, out: &mut Tensor, lse: Option<&mut Tensor>) -> Result<()> {
        let ptrs = self.device_ptrs(c.call, out, lse.as_deref())?;
        // SAFETY: the pointers are this backend's own allocations holding the validated tensors
        // (`Tensor` checks its storage size against its shape); `out` and `lse` are borrowed
        // mutably, so they alias no input; frees are stream-ordered after the launch.
        unsafe { self.launch(c, ptrs) }
    }
}

/// Device addresses of one call's tensors, for [`CudaBackend::launch`].
#[derive(Clone, Copy, Debug)]
pub struct DevicePtrs {
    /// q, row-major in the call's layout.
    pub q: u64,
    /// k (or the k cache).
    pub k: u64,
    /// v (or the v cache).
    pub v: u64,
    /// The output.
    pub out: u64,
    /// The lse, or 0 when the call returns none.
    pub lse: u64,
}

impl CudaBackend {
    /// Run a validated call on tensors given by device address: the path for memory another
    /// library owns (candle's tensors). Stream-ordered; nothing waits for the device.
    ///
    /// # Safety
    /// Each pointer must address live device memory in this backend's context holding at least
    /// the elements `c` describes, in its dtype, contiguous and row-major (`lse`: f32, or 0 when
    /// `c` returns none); `out` and `lse` must be writable and overlap no input and each other;
    /// everything must stay allocated until the work queued on [`CudaBackend::stream`] is done.
    pub unsafe fn launch(&self, c: &Checked<'_>, ptrs: DevicePtrs) -> Result<()> {
        // SAFETY: the caller's contract, and no caller workspace.
        unsafe { self.launch_with(c, ptrs, None) }
    }

    /// [`AttentionBackend::forward`] into the caller's `out` (and `lse`), with the split-KV
    /// partials in the caller's `workspace` instead of the backend's own buffer (which is then
    /// neither used nor grown): an f32 tensor on this device of at least
    /// [`CudaBackend::workspace_bytes`] / 4 elements (any shape; a call that needs none ignores
    /// it). Nothing is allocated, and nothing waits for the device. The workspace's contents need
    /// no initialising and are scratch after the call; it must not be used by another call on
    /// another stream at the same time. A workspace of the wrong dtype, device or size is a
    /// typed error, before any work.
    pub fn forward_with_workspace(
        &self,
        call: &AttnCall<'_>,
        out: &mut Tensor,
        lse: Option<&mut Tensor>,
        workspace: &mut Tensor,
    ) -> Result<()> {
        let c = validate(call, self.device(), NAME, Some(out), lse.as_deref())?;
        self.supports(&c.problem(lse.is_some()))?;
        if workspace.dtype() != DType::F32 {
            return Err(Error::DType { arg: "workspace", got: workspace.dtype(), expected: "f32".into() });
        }
        let ws = self.storage("workspace", workspace)?;
        let (need, have) = (self.workspace_bytes(&c), (workspace.elem_count() * 4).min(ws.len_bytes()));
        if have < need {
            return Err(Error::value("workspace", format!("{have} bytes"), format!("this call needs {need} bytes")));
        }
        let ptrs = self.device_ptrs(call, out, lse.as_deref())?;
        let ws_ptr = ws.ptr(&self.stream);
        // SAFETY: as in `forward_into`; the workspace is this backend's allocation of at least
        // the bytes the plan needs, borrowed mutably, so it aliases no input or output.
        unsafe { self.launch_with(&c, ptrs, Some(ws_ptr)) }
    }

    /// [`CudaBackend::launch`], with the split-KV partials at `workspace` (at least the plan's
    /// bytes) when given, else in the backend's own buffer.
    ///
    /// # Safety
    /// As for [`CudaBackend::launch`]; `workspace` must address that many writable bytes that
    /// nothing else uses until the work is done.
    unsafe fn launch_with(&self, c: &Checked<'_>, ptrs: DevicePtrs, workspace: Option<u64>) -> Result<()> {
        let call = c.call;
        let (o_ptr, lse_ptr) = (ptrs.out, ptrs.lse);
        if c.total_q == 0 || c.batch == 0 {
            return Ok(());
        }
        if c.batch > 65535 || c.hq > 65535 {
            return Err(be_err(format!("batch {} or heads {} above the grid limit 65535", c.batch, c.hq)));
        }
        // The kernels index k/v rows (tokens, or cache slots) with 31 bits.
        let kv_rows = match call.layout {
            Layout::Dense => c.batch * c.dense_sk,
            Layout::Varlen { cu_seqlens_k, .. } => cu_seqlens_k.last().map_or(0, |&n| n.max(0) as usize),
            Layout::Paged { .. } => c.num_blocks * c.block_size,
        };
        if kv_rows > i32::MAX as usize {
            return Err(be_err(format!("k/v hold {kv_rows} rows, above the kernels' limit {}", i32::MAX)));
        }
        let plan = self.plan(c);
        let loaded = self.kernel(&plan, c.dtype)?;
        self.ctx.bind_to_thread().map_err(be_err)?;

        let mut st = self.state.lock().map_err(|_| be_err("state lock poisoned"))?;
        // Metadata, one i32 buffer: [cu_q | cu_k | block_table | seq_lens | alibi bits], built in
        // the vector the state keeps (no allocation once it has grown).
        let mut meta = std::mem::take(&mut st.meta);
        meta.clear();
        let mut off = [usize::MAX; 5];
        let mut push = |slot: usize, xs: &mut dyn Iterator<Item = i32>, meta: &mut Vec<i32>| {
            off[slot] = meta.len();
            meta.extend(xs);
        };
        match call.layout {
            Layout::Dense => {}
            Layout::Varlen { cu_seqlens_q, cu_seqlens_k } => {
                push(0, &mut cu_seqlens_q.iter().copied(), &mut meta);
                push(1, &mut cu_seqlens_k.iter().copied(), &mut meta);
            }
            Layout::Paged { cu_seqlens_q, block_table, seq_lens, .. } => {
                push(0, &mut cu_seqlens_q.iter().copied(), &mut meta);
                push(2, &mut block_table.iter().copied(), &mut meta);
                push(3, &mut seq_lens.iter().copied(), &mut meta);
            }
        }
        if let Some(sl) = call.alibi_slopes {
            push(4, &mut sl.iter().map(|x| x.to_bits() as i32), &mut meta);
        }

        let uploaded = self.upload_meta(&mut st, &meta);
        st.meta = meta;
        uploaded?;
        let ws_elems = plan.workspace_elems(c);
        if ws_elems > 0 && workspace.is_none() {
            self.ensure_workspace(&mut st, ws_elems)?;
        }
        let meta_base = st.meta_dev.as_ref().map(|m| m.device_ptr(&self.stream).0).unwrap_or(0);
        let mptr = |slot: usize| if off[slot] == usize::MAX { 0 } else { meta_base + 4 * off[slot] as u64 };
        let base = match (workspace, &st.workspace) {
            (Some(p), _) => Some(p),
            (None, Some(w)) => Some(w.device_ptr(&self.stream).0),
            (None, None) => None,
        };
        let (ws_o, ws_l) = match base {
            Some(base) if ws_elems > 0 => {
                let o_elems = ws_elems / (c.d + 1) * c.d;
                (base, base + 4 * o_elems as u64)
            }
            _ => (0, 0),
        };

        let p = &call.params;
        let clamp = |w: Option<usize>| w.map(|w| w.min(1 << 30) as i32).unwrap_or(-1);
        let (max_blocks, layout_code) = match call.layout {
            Layout::Dense => (0, 0),
            Layout::Varlen { .. } => (0, 1),
            Layout::Paged { max_blocks, .. } => (max_blocks, 2),
        };
        let splits = match plan {
            Plan::Decode { splits, .. } | Plan::Mma { splits, .. } => splits,
            _ => 1,
        };
        // Power-of-two blocks are addressed with shifts.
        let bs_shift = if c.block_size.is_power_of_two() { c.block_size.trailing_zeros() as i32 } else { -1 };
        let kp = KernelParams {
            q: ptrs.q,
            k: ptrs.k,
            v: ptrs.v,
            o: o_ptr,
            lse: lse_ptr,
            o_part: ws_o,
            lse_part: ws_l,
            cu_q: mptr(0),
            cu_k: mptr(1),
            block_table: mptr(2),
            seq_lens: mptr(3),
            alibi: mptr(4),
            q_stride: (c.hq * c.d) as i64,
            kv_stride: (c.hkv * c.d) as i64,
            batch: c.batch as i32,
            hq: c.hq as i32,
            hkv: c.hkv as i32,
            d: c.d as i32,
            group: c.group() as i32,
            layout: layout_code,
            dense_sq: c.dense_sq as i32,
            dense_sk: c.dense_sk as i32,
            block_size: c.block_size as i32,
            max_blocks: max_blocks as i32,
            total_q: c.total_q as i32,
            causal: p.causal as i32,
            window_left: clamp(p.window_left),
            window_right: clamp(p.window_right),
            num_splits: splits as i32,
            bs_shift,
            scale: c.scale,
            softcap: p.softcap.unwrap_or(0.0),
            scale_log2: c.scale * std::f32::consts::LOG2_E,
            pad1: 0.0,
        };
        if c.total_q.checked_mul(c.hq * c.d).is_none_or(|n| n > i64::MAX as usize) {
            return Err(be_err("tensor too large"));
        }
        let (func_name, cfg) = match plan {
            Plan::Simt { .. } => (
                "attn_simt",
                LaunchConfig {
                    grid_dim: (c.max_q.div_ceil(32) as u32, c.hq as u32, c.batch as u32),
                    block_dim: (128, 1, 1),
                    shared_mem_bytes: simt_smem_for(c.d) as u32,
                },
            ),
            Plan::Decode { splits, .. } => (
                "attn_decode",
                LaunchConfig {
                    grid_dim: (splits as u32, c.hkv as u32, c.batch as u32),
                    block_dim: (128, 1, 1),
                    shared_mem_bytes: 0,
                },
            ),
            Plan::Mma { t, splits } => (
                "attn_mma",
                LaunchConfig {
                    grid_dim: (
                        (c.max_q * c.group()).div_ceil(t.bm) as u32 * splits as u32,
                        c.hkv as u32,
                        c.batch as u32,
                    ),
                    block_dim: ((t.nw * 32) as u32, 1, 1),
                    shared_mem_bytes: t.smem_bytes() as u32,
                },
            ),
        };
        let func = &loaded.funcs[func_name];
        // SAFETY: `kp` matches the kernel's `AttnParams`; the tensor pointers hold what the kernel
        // indexes by this function's contract (validated shapes), the metadata and workspace were
        // sized above, and all of it outlives the launch (stream-ordered frees).
        unsafe { self.launch_params(func, cfg, &kp) }.map_err(|e| be_err(format!("launching {func_name}: {e}")))?;
        if splits > 1 {
            let comb = &loaded.funcs["attn_combine"];
            // One CTA per (token, head).
            let rows = u32::try_from(c.total_q * c.hq)
                .ok()
                .filter(|&r| r <= i32::MAX as u32)
                .ok_or_else(|| be_err(format!("{} query rows to merge, above the grid limit", c.total_q * c.hq)))?;
            let cfg = LaunchConfig { grid_dim: (rows, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
            // SAFETY: as above; the combine kernel reads the partials the split kernel wrote
            // earlier on the same stream.
            unsafe { self.launch_params(comb, cfg, &kp) }
                .map_err(|e| be_err(format!("launching attn_combine: {e}")))?;
        }
        drop(st);
        let _ = LayoutKind::Dense;
        Ok(())
    }
}
