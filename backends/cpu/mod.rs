//! `cpu`: tiled online-softmax (flash) attention on the host, parallel over sequences, GQA
//! groups, query blocks and (for decode) key splits with rayon. SIMD microkernels for q·kᵀ and
//! p·v are chosen at run time (AVX-512, AVX2+FMA+F16C, or portable lanes that become NEON on
//! aarch64); f16/bf16 inputs are widened to f32 in registers as each tile is packed, and
//! accumulation is f32.
//!
//! With caller buffers `forward` allocates nothing once warm: tile scratch lives in per-thread
//! buffers, and the key-split partials of decode in a buffer the backend keeps; both grow on first
//! use and are reused after.

mod kernel;
mod peak;
mod pool;
mod simd;

use std::sync::Mutex;

pub use peak::fma_peak_gflops;
// The kernel on host slices of a validated call, for glue whose tensors own their memory (candle):
// it runs on their storage without copying it into a `Tensor`.
// Key-split partials come from a process-wide buffer (grown once), as the glue has no backend.
#[cfg(feature = "candle")]
pub(crate) fn run_slices<T: kernel::Element>(
    c: &Checked<'_>,
    q: &[T],
    k: &[T],
    v: &[T],
    out: &mut [T],
    lse: Option<&mut [f32]>,
) {
    static PARTIAL: Mutex<Vec<f32>> = Mutex::new(Vec::new());
    let mut partial = PARTIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (mut lse, partial) = (lse, &mut *partial);
    pool::run(|| kernel::run(c, q, k, v, out, lse.as_deref_mut(), partial))
}

use crate::backend::{host_memory_impl, AttentionBackend};
use crate::call::{Capabilities, HeadDims};
use crate::error::{Error, Result};
use crate::types::{Device, HostData, Tensor};
use crate::validate::Checked;

/// Largest head dim the cpu backend declares.
pub const MAX_HEAD_DIM: usize = 512;

static CPU_CAPS: Capabilities = Capabilities::full(HeadDims::UpTo(MAX_HEAD_DIM));

/// The cpu backend.
#[derive(Debug, Default)]
pub struct CpuBackend {
    /// Partial (m, l, o) of key splits, grown to the largest call seen.
    partial: Mutex<Vec<f32>>,
}

impl CpuBackend {
    /// The cpu backend (its worker pool starts on the first call).
    pub fn new() -> Result<Self> {
        Ok(CpuBackend::default())
    }
    /// The instruction set the kernel uses on this machine (`avx512`, `avx2+fma`, `portable`).
    pub fn isa() -> &'static str {
        match kernel::isa() {
            #[cfg(target_arch = "x86_64")]
            kernel::Isa::Avx512 => "avx512",
            #[cfg(target_arch = "x86_64")]
            kernel::Isa::Avx2 => "avx2+fma",
            kernel::Isa::Portable => "portable",
        }
    }
}

fn not_host(arg: &'static str) -> Error {
    Error::Backend { backend: "cpu", msg: format!("`{arg}` is not host memory") }
}

impl AttentionBackend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }
    fn device(&self) -> Device {
        Device::Host
    }
    fn capabilities(&self) -> &Capabilities {
        &CPU_CAPS
    }
    host_memory_impl!("cpu");
    fn forward_into(&self, c: &Checked<'_>, out: &mut Tensor, lse: Option<&mut Tensor>) -> Result<()> {
        let q = c.call.q.host().ok_or_else(|| not_host("q"))?;
        let k = c.call.k.host().ok_or_else(|| not_host("k"))?;
        let v = c.call.v.host().ok_or_else(|| not_host("v"))?;
        let lse = match lse {
            Some(l) => match l.host_mut() {
                Some(HostData::F32(x)) => Some(x.as_mut_slice()),
                _ => return Err(not_host("lse")),
            },
            None => None,
        };
        let o = out.host_mut().ok_or_else(|| not_host("out"))?;
        let mut partial = self.partial.lock().unwrap_or_else(|e| e.into_inner());
        let partial = &mut *partial;
        let mut lse = lse;
        match (q, k, v, o) {
            (HostData::F32(q), HostData::F32(k), HostData::F32(v), HostData::F32(o)) => {
                pool::run(|| kernel::run(c, q, k, v, o, lse.as_deref_mut(), partial))
            }
            (HostData::F16(q), HostData::F16(k), HostData::F16(v), HostData::F16(o)) => {
                pool::run(|| kernel::run(c, q, k, v, o, lse.as_deref_mut(), partial))
            }
            (HostData::BF16(q), HostData::BF16(k), HostData::BF16(v), HostData::BF16(o)) => {
                pool::run(|| kernel::run(c, q, k, v, o, lse.as_deref_mut(), partial))
            }
            _ => {
                return Err(Error::Backend { backend: "cpu", msg: "q, k, v and out must share one float dtype".into() })
            }
        }
        Ok(())
    }
}
