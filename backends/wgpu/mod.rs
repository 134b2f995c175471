//! `wgpu` backend (placeholder until its kernels land).

use crate::backend::AttentionBackend;
use crate::call::Capabilities;
use crate::error::{Error, Result};
use crate::types::{DType, Device, Tensor};
use crate::validate::Checked;

/// Device memory of the `wgpu` backend.
#[derive(Debug)]
pub struct WgpuStorage {
    device: Device,
}

impl WgpuStorage {
    /// The device the memory is on.
    pub fn device(&self) -> Device {
        self.device
    }
}

/// The `wgpu` backend.
#[derive(Debug)]
pub struct WgpuBackend {
    caps: Capabilities,
}

impl WgpuBackend {
    /// Not yet available.
    pub fn new() -> Result<Self> {
        Err(Error::NoDevice { backend: "wgpu", msg: "the wgpu backend is not implemented yet".into() })
    }
}

impl AttentionBackend for WgpuBackend {
    fn name(&self) -> &'static str {
        "wgpu"
    }
    fn device(&self) -> Device {
        Device::Host
    }
    fn capabilities(&self) -> &Capabilities {
        &self.caps
    }
    fn alloc(&self, _: &[usize], _: DType) -> Result<Tensor> {
        Err(Error::NoDevice { backend: "wgpu", msg: "not implemented".into() })
    }
    fn upload(&self, _: &Tensor) -> Result<Tensor> {
        Err(Error::NoDevice { backend: "wgpu", msg: "not implemented".into() })
    }
    fn download(&self, _: &Tensor) -> Result<Tensor> {
        Err(Error::NoDevice { backend: "wgpu", msg: "not implemented".into() })
    }
    fn write(&self, _: &mut Tensor, _: &Tensor) -> Result<()> {
        Err(Error::NoDevice { backend: "wgpu", msg: "not implemented".into() })
    }
    fn forward_into(&self, _: &Checked<'_>, _: &mut Tensor, _: Option<&mut Tensor>) -> Result<()> {
        Err(Error::NoDevice { backend: "wgpu", msg: "not implemented".into() })
    }
}
