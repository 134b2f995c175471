//! Backends whose feature is off: the same names, uninhabited types, and constructors that say
//! which feature to turn on. No `unimplemented!()` anywhere.

#[allow(unused_macros)]
macro_rules! stub_backend {
    ($module:ident, $ty:ident, $name:literal, $feature:literal) => {
        #[doc = concat!("The `", $name, "` backend was not compiled in (cargo feature `", $feature, "`).")]
        pub mod $module {
            use crate::backend::AttentionBackend;
            use crate::call::Capabilities;
            use crate::error::{Error, Result};
            use crate::types::{DType, Device, Tensor};
            use crate::validate::Checked;

            #[doc = concat!("Stand-in for the `", $name, "` backend: it cannot be constructed.")]
            #[derive(Debug)]
            pub enum $ty {}

            impl $ty {
                #[doc = concat!("Always [`Error::NotCompiled`]: build with `--features ", $feature, "`.")]
                pub fn new() -> Result<Self> {
                    Err(Error::NotCompiled { backend: $name, feature: $feature })
                }
            }

            impl AttentionBackend for $ty {
                fn name(&self) -> &'static str {
                    match *self {}
                }
                fn device(&self) -> Device {
                    match *self {}
                }
                fn capabilities(&self) -> &Capabilities {
                    match *self {}
                }
                fn alloc(&self, _: &[usize], _: DType) -> Result<Tensor> {
                    match *self {}
                }
                fn upload(&self, _: &Tensor) -> Result<Tensor> {
                    match *self {}
                }
                fn download(&self, _: &Tensor) -> Result<Tensor> {
                    match *self {}
                }
                fn write(&self, _: &mut Tensor, _: &Tensor) -> Result<()> {
                    match *self {}
                }
                fn forward_into(&self, _: &Checked<'_>, _: &mut Tensor, _: Option<&mut Tensor>) -> Result<()> {
                    match *self {}
                }
            }
        }
    };
}

#[cfg(not(feature = "cpu"))]
stub_backend!(cpu, CpuBackend, "cpu", "cpu");
#[cfg(not(feature = "wgpu"))]
stub_backend!(wgpu, WgpuBackend, "wgpu", "wgpu");
#[cfg(not(feature = "cuda"))]
stub_backend!(cuda, CudaBackend, "cuda", "cuda");
