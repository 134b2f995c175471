//! `cpu`: tiled online-softmax (flash) attention on the host, parallel over sequences, heads and
//! query blocks with rayon. f16/bf16 inputs are widened to f32 tile by tile; accumulation is f32.
//!
//! With caller buffers `forward` allocates nothing once warm: tile scratch lives in per-thread
//! buffers that grow on first use and are reused after.

mod kernel;
mod peak;

pub use peak::fma_peak_gflops;

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
    _priv: (),
}

impl CpuBackend {
    /// The cpu backend on rayon's global pool.
    pub fn new() -> Result<Self> {
        Ok(CpuBackend { _priv: () })
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
        match (q, k, v, o) {
            (HostData::F32(q), HostData::F32(k), HostData::F32(v), HostData::F32(o)) => kernel::run(c, q, k, v, o, lse),
            (HostData::F16(q), HostData::F16(k), HostData::F16(v), HostData::F16(o)) => kernel::run(c, q, k, v, o, lse),
            (HostData::BF16(q), HostData::BF16(k), HostData::BF16(v), HostData::BF16(o)) => {
                kernel::run(c, q, k, v, o, lse)
            }
            _ => {
                return Err(Error::Backend { backend: "cpu", msg: "q, k, v and out must share one float dtype".into() })
            }
        }
        Ok(())
    }
}
