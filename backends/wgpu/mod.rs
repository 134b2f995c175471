//! `wgpu`: tiled flash attention in WGSL, on any GPU wgpu reaches (Vulkan, Metal, DX12; Mesa's
//! lavapipe in CI).
//!
//! - Two kernels, specialised per (dtype, head dim, tile) and compiled once per configuration:
//!   `shaders/flash_attn_mt.wgsl` (4x4 register micro-tiles) for calls with 32+ rows per
//!   sequence, `shaders/flash_attn.wgsl` (`Rows`: a thread per key for the scores, a thread per
//!   (column, key slot) for the output) for short-query calls.
//!   A row is a (query, query head of the GQA group) pair, so a group shares each K/V tile.
//!   Short-query, long-key calls split the keys; `shaders/combine.wgsl` merges the splits by lse.
//! - Every dtype is read as 8-byte words: two f32, or four f16/bf16 unpacked to f32 in registers
//!   (`unpack2x16float`, a shift for bf16), so the kernels need no optional feature (not even
//!   `shader-f16`); output is packed back (round-to-nearest-even for bf16).
//! - Arithmetic is f32; no subgroup operations, so nothing depends on the subgroup size.
//! - With caller buffers `forward` allocates no device memory once warm: the metadata buffer and the
//!   split-KV scratch grow only when a call needs more, and bind groups are cached per buffer set.
//!
//! [`WgpuBackend::new`] opens (once per process) the adapter wgpu prefers for high performance;
//! [`WgpuBackend::from_device`] runs on a caller's device and queue, so a model shares them.

mod kernel;
mod spirv;
mod unroll;

pub use kernel::{Kernel, RowsTuning};

/// The SPIR-V of the kernels the bench times, named; see `tests/wgsl_bench.rs`
/// (`kernel_statistics`). Diagnosis only, not a stable interface.
#[doc(hidden)]
pub fn bench_kernel_modules() -> Result<Vec<(String, Vec<u32>)>> {
    kernel::bench_modules()
}

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use crate::backend::AttentionBackend;
use crate::call::{Capabilities, HeadDims, LayoutKind};
use crate::error::{Error, Result};
use crate::types::{DType, Device, HostData, Storage, Tensor};
use crate::validate::Checked;

const NAME: &str = "wgpu";

/// Largest head dim the kernel is built for (when the device's workgroup memory allows it).
pub const MAX_HEAD_DIM: usize = 256;

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

fn backend_err(msg: impl Into<String>) -> Error {
    Error::Backend { backend: NAME, msg: msg.into() }
}

/// Device memory of the `wgpu` backend: one storage buffer, its size rounded up to whole 8-byte
/// words (at least one).
#[derive(Debug, Clone)]
pub struct WgpuStorage {
    buffer: ::wgpu::Buffer,
    device: Device,
}

impl WgpuStorage {
    /// The device the memory is on.
    pub fn device(&self) -> Device {
        self.device
    }
    /// The buffer (usage `STORAGE | COPY_SRC | COPY_DST`), to hand to a model's own passes.
    pub fn buffer(&self) -> &::wgpu::Buffer {
        &self.buffer
    }
}

/// Bytes of a buffer holding `n` elements of `dtype`: whole 8-byte words (the kernels read
/// tensors as `vec2<u32>`), at least one.
fn buffer_bytes(n: usize, dtype: DType) -> u64 {
    ((n * dtype.size()).div_ceil(8).max(1) * 8) as u64
}

/// What is shared by every backend instance on one wgpu device.
pub(crate) struct Ctx {
    id: u64,
    pub(crate) device: ::wgpu::Device,
    pub(crate) queue: ::wgpu::Queue,
    adapter_name: String,
    pub(crate) limits: ::wgpu::Limits,
    /// The device has cooperative matrices the coop kernel can use (16x16x16 f16 x f16 -> f32,
    /// subgroups of exactly 32), with `shader-f16` and subgroups enabled.
    pub(crate) coop: bool,
    pub(crate) state: Mutex<kernel::State>,
}

impl std::fmt::Debug for Ctx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ctx").field("id", &self.id).field("adapter", &self.adapter_name).finish()
    }
}

impl Ctx {
    fn new(device: ::wgpu::Device, queue: ::wgpu::Queue, adapter_name: String, coop: bool) -> Ctx {
        let limits = device.limits();
        let state = Mutex::new(kernel::State::new(&device));
        Ctx { id: NEXT_ID.fetch_add(1, Ordering::Relaxed), device, queue, adapter_name, limits, coop, state }
    }

    /// Run `f` inside validation and out-of-memory error scopes; a captured error becomes `Err`.
    pub(crate) fn scoped<T>(&self, what: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let oom = self.device.push_error_scope(::wgpu::ErrorFilter::OutOfMemory);
        let val = self.device.push_error_scope(::wgpu::ErrorFilter::Validation);
        let r = f();
        let e_val = pollster::block_on(val.pop());
        let e_oom = pollster::block_on(oom.pop());
        if let Some(e) = e_val.or(e_oom) {
            return Err(backend_err(format!("{what}: {e}")));
        }
        r
    }

    fn wait(&self) -> Result<()> {
        self.device
            .poll(::wgpu::PollType::wait_indefinitely())
            .map(|_| ())
            .map_err(|e| backend_err(format!("waiting for the device: {e}")))
    }
}

/// The process-wide default context, opened on first use. An adapter that fails is retried on
/// the next call, so a transient failure is not remembered.
fn default_ctx() -> Result<Arc<Ctx>> {
    static CTX: OnceLock<Mutex<Option<Arc<Ctx>>>> = OnceLock::new();
    let cell = CTX.get_or_init(|| Mutex::new(None));
    let mut slot = cell.lock().map_err(|_| backend_err("context lock poisoned"))?;
    if let Some(c) = slot.as_ref() {
        return Ok(c.clone());
    }
    let ctx = Arc::new(open_default()?);
    *slot = Some(ctx.clone());
    Ok(ctx)
}

fn open_default() -> Result<Ctx> {
    let no_device = |msg: String| Error::NoDevice { backend: NAME, msg };
    let instance = std::panic::catch_unwind(|| {
        ::wgpu::Instance::new(::wgpu::InstanceDescriptor::new_without_display_handle_from_env())
    })
    .map_err(|_| no_device("wgpu could not create an instance".into()))?;
    let opts = ::wgpu::RequestAdapterOptions {
        power_preference: ::wgpu::PowerPreference::HighPerformance,
        ..Default::default()
    };
    let adapter = pollster::block_on(instance.request_adapter(&opts))
        .map_err(|e| no_device(format!("no adapter: {e} (is a Vulkan/Metal/DX12 driver installed?)")))?;
    let info = adapter.get_info();
    let coop = coop_settings().allowed
        && coop_usable(adapter.features(), &info)
        && adapter.cooperative_matrix_properties().iter().any(|p| {
            use ::wgpu::CooperativeScalarType as T;
            (p.m_size, p.n_size, p.k_size) == (16, 16, 16) && p.ab_type == T::F16 && p.cr_type == T::F32
        });
    let open = |coop: bool| {
        let desc = ::wgpu::DeviceDescriptor {
            label: Some("attnkit"),
            // Pass-through shaders on Vulkan wherever the adapter has them: the micro-tile
            // kernel's SPIR-V is written here (kernel.rs, `mt_pipeline`).
            required_features: (if coop { COOP_FEATURES } else { ::wgpu::Features::empty() })
                | if info.backend == ::wgpu::Backend::Vulkan {
                    adapter.features() & ::wgpu::Features::PASSTHROUGH_SHADERS
                } else {
                    ::wgpu::Features::empty()
                },
            // Everything the adapter offers: larger workgroup memory means larger tiles and head dims.
            required_limits: adapter.limits(),
            experimental_features: if coop {
                // SAFETY: the token admits wgpu's experimental cooperative-matrix feature, which
                // may have bugs of its own; we use it only in the one kernel built for it
                // (shaders/flash_attn_coop.wgsl), only where the adapter reports the 16x16x16 f16
                // matrices that kernel uses, and `ATTNKIT_WGPU_COOP=off` leaves it out entirely.
                unsafe { ::wgpu::ExperimentalFeatures::enabled() }
            } else {
                ::wgpu::ExperimentalFeatures::disabled()
            },
            ..Default::default()
        };
        pollster::block_on(adapter.request_device(&desc))
    };
    // A device with cooperative matrices, else (if that is refused) a plain one.
    let (opened, coop) = match coop.then(|| open(true)) {
        Some(Ok(d)) => (Ok(d), true),
        _ => (open(false), false),
    };
    let (device, queue) =
        opened.map_err(|e| no_device(format!("adapter {} would not open a device: {e}", info.name)))?;
    // Our own device: errors are caught by scopes around each operation, never by a panic.
    device.on_uncaptured_error(Arc::new(|e| eprintln!("attnkit wgpu: uncaptured device error: {e}")));
    let name = format!("{} ({:?}{})", info.name, info.backend, if coop { ", cooperative matrices" } else { "" });
    Ok(Ctx::new(device, queue, name, coop))
}

/// What the cooperative-matrix kernel needs of a device: pass-through shaders too, because its
/// SPIR-V is written and mended here (see spirv.rs).
const COOP_FEATURES: ::wgpu::Features = ::wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX
    .union(::wgpu::Features::SHADER_F16)
    .union(::wgpu::Features::SUBGROUP)
    .union(::wgpu::Features::PASSTHROUGH_SHADERS);

/// The cooperative-matrix kernel's settings from the environment, read once per process.
#[derive(Clone, Copy, Debug)]
pub(crate) struct CoopSettings {
    /// `ATTNKIT_WGPU_COOP=off` keeps the kernel out entirely (the device is opened without the
    /// features).
    pub allowed: bool,
    /// Whether the planner chooses the kernel by itself where it fits (the default);
    /// `ATTNKIT_WGPU_COOP=manual` opens the device with the features but runs the kernel only
    /// where asked for ([`WgpuBackend::set_kernel`] with [`Kernel::Coop`]), for comparisons.
    pub auto: bool,
    /// `ATTNKIT_WGPU_COOP_TILE=NW,BK` (subgroups, key tile): a tuning knob. A tile the kernel
    /// cannot take (BK a multiple of 16, at least 8 NW, dividing the head dim) or that does not
    /// fit the workgroup memory is passed over.
    pub tile: Option<(usize, usize)>,
    /// `ATTNKIT_WGPU_COOP_DEBUG=n` (diagnosis only, see flash_attn_coop.wgsl): the kernel stops
    /// after stage n of its first tile and writes that stage out; 0, the default, runs it whole.
    pub debug: usize,
}

/// [`CoopSettings`] of this process.
pub(crate) fn coop_settings() -> CoopSettings {
    static S: std::sync::OnceLock<CoopSettings> = std::sync::OnceLock::new();
    *S.get_or_init(|| {
        let mode = std::env::var("ATTNKIT_WGPU_COOP").unwrap_or_default();
        let tile = std::env::var("ATTNKIT_WGPU_COOP_TILE").ok().and_then(|v| {
            let (a, b) = v.split_once(',')?;
            Some((a.trim().parse().ok()?, b.trim().parse().ok()?))
        });
        let debug = std::env::var("ATTNKIT_WGPU_COOP_DEBUG").ok().and_then(|v| v.parse().ok()).unwrap_or(0);
        CoopSettings { allowed: mode != "off", auto: mode != "manual", tile, debug }
    })
}

/// The features are there, and subgroups are exactly 32 wide (the kernel's strips assume it), on
/// Vulkan (whose cooperative matrices the kernel's 16x16 f16 shape was checked against).
fn coop_usable(features: ::wgpu::Features, info: &::wgpu::AdapterInfo) -> bool {
    features.contains(COOP_FEATURES)
        && info.subgroup_min_size == 32
        && info.subgroup_max_size == 32
        && info.backend == ::wgpu::Backend::Vulkan
}

/// The `wgpu` backend.
#[derive(Debug, Clone)]
pub struct WgpuBackend {
    ctx: Arc<Ctx>,
    caps: Capabilities,
    kv_splits: Option<usize>,
    kernel: Option<Kernel>,
    rows: RowsTuning,
}

impl WgpuBackend {
    /// The backend on the process-wide default device (the adapter wgpu prefers for high
    /// performance, honouring `WGPU_BACKEND`). [`Error::NoDevice`] when there is none.
    pub fn new() -> Result<Self> {
        Ok(Self::with_ctx(default_ctx()?))
    }

    /// The backend on a caller's device and queue (a model that already has them shares them).
    /// Each call makes a new backend [`Device`] id: tensors of one such backend are not accepted
    /// by another, even over the same `wgpu::Device`.
    ///
    /// The cooperative-matrix kernel serves f16 prefill on this device when the caller opened it
    /// with `EXPERIMENTAL_COOPERATIVE_MATRIX`, `SHADER_F16` and `SUBGROUP` on a Vulkan adapter
    /// with 32-wide subgroups (and `ATTNKIT_WGPU_COOP` is not `off`); the caller vouches that the
    /// adapter offers 16x16x16 f16 matrices, which [`::wgpu::Adapter::cooperative_matrix_properties`]
    /// tells.
    pub fn from_device(device: ::wgpu::Device, queue: ::wgpu::Queue) -> Self {
        let coop = coop_settings().allowed && coop_usable(device.features(), &device.adapter_info());
        Self::with_ctx(Arc::new(Ctx::new(device, queue, "caller device".into(), coop)))
    }

    /// Whether the cooperative-matrix kernel is available on this device.
    pub fn has_cooperative_matrices(&self) -> bool {
        self.ctx.coop
    }

    /// Whether the micro-tile kernel runs from attnkit's own SPIR-V, with array indices left
    /// unclamped (a device with pass-through shaders, on Vulkan), rather than through wgpu's
    /// shader translation. For tests and diagnosis.
    #[doc(hidden)]
    pub fn micro_tile_passthrough(&self) -> bool {
        self.ctx.state.lock().unwrap_or_else(|e| e.into_inner()).mt_passthrough
    }

    fn with_ctx(ctx: Arc<Ctx>) -> Self {
        let max_d = kernel::max_head_dim(ctx.limits.max_compute_workgroup_storage_size);
        let caps = Capabilities::full(HeadDims::MultipleOf { step: 4, max: max_d });
        WgpuBackend { ctx, caps, kv_splits: None, kernel: None, rows: RowsTuning::default() }
    }

    /// Force the number of key/value splits (`Some(1)` turns split-KV off, `None` lets the backend
    /// choose from the problem's shape). For tests and tuning.
    pub fn set_kv_splits(&mut self, splits: Option<usize>) {
        self.kv_splits = splits.map(|s| s.clamp(1, kernel::MAX_SPLITS));
    }

    /// Force a kernel variant (`None` lets the backend choose from the problem's shape). For tests
    /// and tuning; a variant that does not fit the device's workgroup memory falls back to `Rows`.
    pub fn set_kernel(&mut self, kernel: Option<Kernel>) {
        self.kernel = kernel;
    }

    /// Tune the `Rows` kernel and the split-KV heuristic (`None`: the default). For benchmarks
    /// and tuning sweeps; fields outside their documented ranges are clamped into them. Each
    /// tuning compiles its own pipelines, once.
    pub fn set_rows_tuning(&mut self, tuning: Option<RowsTuning>) {
        self.rows = tuning.map(RowsTuning::clamped).unwrap_or_default();
    }

    /// The wgpu device.
    pub fn wgpu_device(&self) -> &::wgpu::Device {
        &self.ctx.device
    }

    /// The wgpu queue.
    pub fn wgpu_queue(&self) -> &::wgpu::Queue {
        &self.ctx.queue
    }

    /// The adapter's name and graphics API.
    pub fn adapter_name(&self) -> &str {
        &self.ctx.adapter_name
    }

    /// The limits the device was opened with.
    pub fn limits(&self) -> &::wgpu::Limits {
        &self.ctx.limits
    }

    /// Wrap a caller's buffer as a tensor of this backend. The buffer needs usage `STORAGE` (and
    /// `COPY_SRC`/`COPY_DST` for download/write) and at least `shape.product() * dtype.size()` bytes
    /// rounded up to a multiple of 8.
    pub fn tensor_from_buffer(&self, buffer: ::wgpu::Buffer, shape: &[usize], dtype: DType) -> Result<Tensor> {
        let need = buffer_bytes(shape.iter().product(), dtype);
        if buffer.size() < need {
            return Err(Error::value(
                "buffer.size()",
                buffer.size(),
                format!("needs {need} bytes for {shape:?} {dtype}"),
            ));
        }
        if !buffer.usage().contains(::wgpu::BufferUsages::STORAGE) {
            return Err(Error::value("buffer.usage()", format!("{:?}", buffer.usage()), "needs STORAGE"));
        }
        Ok(Tensor::from_storage(shape, dtype, Storage::Wgpu(WgpuStorage { buffer, device: self.device() })))
    }

    fn storage<'t>(&self, arg: &'static str, t: &'t Tensor) -> Result<&'t WgpuStorage> {
        match t.storage() {
            Storage::Wgpu(s) if s.device == self.device() => Ok(s),
            _ => Err(Error::Device { arg, got: t.device(), expected: self.device(), backend: NAME }),
        }
    }

    fn new_buffer(&self, bytes: u64) -> Result<::wgpu::Buffer> {
        if bytes > self.ctx.limits.max_buffer_size {
            return Err(backend_err(format!(
                "a buffer of {bytes} bytes exceeds the device's max_buffer_size {}",
                self.ctx.limits.max_buffer_size
            )));
        }
        self.ctx.scoped("allocating a buffer", || {
            Ok(self.ctx.device.create_buffer(&::wgpu::BufferDescriptor {
                label: Some("attnkit tensor"),
                size: bytes,
                usage: ::wgpu::BufferUsages::STORAGE | ::wgpu::BufferUsages::COPY_SRC | ::wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            }))
        })
    }
}

/// Host bytes of a host tensor, padded to whole 8-byte words (as [`buffer_bytes`]).
fn padded_bytes(h: &HostData) -> Vec<u8> {
    let mut b = h.to_le_bytes();
    let n = b.len().div_ceil(8).max(1) * 8;
    b.resize(n, 0);
    b
}

impl AttentionBackend for WgpuBackend {
    fn name(&self) -> &'static str {
        NAME
    }
    fn device(&self) -> Device {
        Device::Wgpu(self.ctx.id)
    }
    fn capabilities(&self) -> &Capabilities {
        &self.caps
    }
    fn alloc(&self, shape: &[usize], dtype: DType) -> Result<Tensor> {
        // wgpu zero-initialises new buffers.
        let buffer = self.new_buffer(buffer_bytes(shape.iter().product(), dtype))?;
        Ok(Tensor::from_storage(shape, dtype, Storage::Wgpu(WgpuStorage { buffer, device: self.device() })))
    }
    fn upload(&self, t: &Tensor) -> Result<Tensor> {
        let h = t.host().ok_or(Error::Device { arg: "t", got: t.device(), expected: Device::Host, backend: NAME })?;
        let bytes = padded_bytes(h);
        let buffer = self.new_buffer(bytes.len() as u64)?;
        self.ctx.scoped("uploading", || {
            self.ctx.queue.write_buffer(&buffer, 0, &bytes);
            Ok(())
        })?;
        Ok(Tensor::from_storage(t.shape(), t.dtype(), Storage::Wgpu(WgpuStorage { buffer, device: self.device() })))
    }
    fn download(&self, t: &Tensor) -> Result<Tensor> {
        let s = self.storage("t", t)?;
        let n = t.elem_count() * t.dtype().size();
        let size = buffer_bytes(t.elem_count(), t.dtype());
        let ctx = &self.ctx;
        let bytes = ctx.scoped("downloading", || {
            let staging = ctx.device.create_buffer(&::wgpu::BufferDescriptor {
                label: Some("attnkit download"),
                size,
                usage: ::wgpu::BufferUsages::MAP_READ | ::wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            });
            let mut enc = ctx.device.create_command_encoder(&Default::default());
            enc.copy_buffer_to_buffer(&s.buffer, 0, &staging, 0, size);
            ctx.queue.submit([enc.finish()]);
            let (tx, rx) = std::sync::mpsc::channel();
            staging.map_async(::wgpu::MapMode::Read, .., move |r| {
                let _ = tx.send(r);
            });
            ctx.wait()?;
            rx.recv()
                .map_err(|_| backend_err("the map callback never ran"))?
                .map_err(|e| backend_err(format!("mapping for download: {e}")))?;
            let view = staging.get_mapped_range(..).map_err(|e| backend_err(format!("{e:?}")))?;
            let out = view[..n].to_vec();
            drop(view);
            staging.unmap();
            Ok(out)
        })?;
        let h = HostData::from_le_bytes(t.dtype(), &bytes).ok_or_else(|| backend_err("downloaded bytes"))?;
        Tensor::from_host(t.shape(), h)
    }
    fn write(&self, dst: &mut Tensor, src: &Tensor) -> Result<()> {
        if dst.shape() != src.shape() || dst.dtype() != src.dtype() {
            return Err(Error::Shape {
                arg: "dst",
                got: dst.shape().to_vec(),
                expected: format!("{:?} {} (the source)", src.shape(), src.dtype()),
            });
        }
        let h =
            src.host().ok_or(Error::Device { arg: "src", got: src.device(), expected: Device::Host, backend: NAME })?;
        let s = self.storage("dst", dst)?;
        let bytes = padded_bytes(h);
        self.ctx.scoped("writing", || {
            self.ctx.queue.write_buffer(&s.buffer, 0, &bytes);
            Ok(())
        })
    }
    fn synchronize(&self) -> Result<()> {
        self.ctx.wait()
    }
    fn forward_into(&self, c: &Checked<'_>, out: &mut Tensor, lse: Option<&mut Tensor>) -> Result<()> {
        let q = self.storage("q", c.call.q)?;
        let k = self.storage(if c.kind == LayoutKind::Paged { "k_cache" } else { "k" }, c.call.k)?;
        let v = self.storage(if c.kind == LayoutKind::Paged { "v_cache" } else { "v" }, c.call.v)?;
        let o = self.storage("out", out)?;
        let l = match lse.as_deref() {
            Some(t) => Some(self.storage("lse", t)?),
            None => None,
        };
        kernel::forward(&self.ctx, c, q, k, v, o, l, self.kv_splits, self.kernel, &self.rows)
    }
}

/// Pipelines cached per configuration, with the key they were built for.
pub(crate) type PipelineCache = HashMap<kernel::PipeKey, ::wgpu::ComputePipeline>;
