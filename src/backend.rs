//! The one trait every backend implements.

use crate::call::{AttnCall, Capabilities, Problem};
use crate::error::{Error, Result, Unsupported};
use crate::types::{DType, Device, Tensor};
use crate::validate::{validate, Checked};

/// What `forward` allocated: `out` when no output buffer was given, `lse` when none was given
/// and the call asked for it.
#[derive(Debug, Default)]
pub struct Outputs {
    /// The allocated output, if `forward` got no buffer.
    pub out: Option<Tensor>,
    /// The allocated lse, if `forward` got no lse buffer and `return_lse` was set.
    pub lse: Option<Tensor>,
}

/// An attention implementation. `forward` is provided and the same for all: it validates, checks
/// capabilities, allocates what the caller did not give, and calls the backend's `forward_into`.
pub trait AttentionBackend: Send + Sync {
    /// `reference`, `cpu`, `wgpu` or `cuda`.
    fn name(&self) -> &'static str;
    /// The device this instance runs on; inputs and buffers must live there.
    fn device(&self) -> Device;
    /// What this instance can run.
    fn capabilities(&self) -> &Capabilities;
    /// `Ok` or the reasons why not.
    fn supports(&self, problem: &Problem) -> std::result::Result<(), Unsupported> {
        self.capabilities().check(self.name(), problem)
    }
    /// Uninitialised-or-zeroed storage of `shape` and `dtype` on this backend's device.
    fn alloc(&self, shape: &[usize], dtype: DType) -> Result<Tensor>;
    /// Copy a host tensor to this backend's device (a host backend returns a copy).
    fn upload(&self, t: &Tensor) -> Result<Tensor>;
    /// Copy a tensor of this backend's device to the host.
    fn download(&self, t: &Tensor) -> Result<Tensor>;
    /// Overwrite a tensor of this backend's device with host data of the same shape and dtype.
    fn write(&self, dst: &mut Tensor, src: &Tensor) -> Result<()>;
    /// Wait for all queued work.
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }
    /// Compute a validated call into `out` (and `lse` when given). Implementations may assume
    /// the call and the buffers passed [`validate`] and the capability check.
    fn forward_into(&self, call: &Checked<'_>, out: &mut Tensor, lse: Option<&mut Tensor>) -> Result<()>;

    /// The one entry point. With `out` (and `lse`) given, the result goes there and nothing is
    /// allocated by attnkit; on any error nothing is written to them.
    fn forward(&self, call: &AttnCall<'_>, out: Option<&mut Tensor>, lse: Option<&mut Tensor>) -> Result<Outputs> {
        let checked = validate(call, self.device(), self.name(), out.as_deref(), lse.as_deref())?;
        let want_lse = lse.is_some() || call.return_lse;
        self.supports(&checked.problem(want_lse))?;
        let mut outputs = Outputs::default();
        let out = match out {
            Some(o) => o,
            None => outputs.out.insert(self.alloc(call.q.shape(), call.q.dtype())?),
        };
        let lse = match lse {
            Some(l) => Some(l),
            None if call.return_lse => Some(outputs.lse.insert(self.alloc(&checked.lse_shape_vec(), DType::F32)?)),
            None => None,
        };
        self.forward_into(&checked, out, lse)?;
        Ok(outputs)
    }
}

pub(crate) fn host_only(backend: &'static str, arg: &'static str, t: &Tensor) -> Error {
    Error::Device { arg, got: t.device(), expected: Device::Host, backend }
}

/// Host `alloc`/`upload`/`download`/`write` for backends whose device is the host.
macro_rules! host_memory_impl {
    ($name:expr) => {
        fn alloc(&self, shape: &[usize], dtype: $crate::DType) -> $crate::Result<$crate::Tensor> {
            Ok($crate::Tensor::zeros(shape, dtype))
        }
        fn upload(&self, t: &$crate::Tensor) -> $crate::Result<$crate::Tensor> {
            t.try_clone_host()
        }
        fn download(&self, t: &$crate::Tensor) -> $crate::Result<$crate::Tensor> {
            t.try_clone_host()
        }
        fn write(&self, dst: &mut $crate::Tensor, src: &$crate::Tensor) -> $crate::Result<()> {
            if dst.shape() != src.shape() || dst.dtype() != src.dtype() {
                return Err($crate::Error::Shape {
                    arg: "dst",
                    got: dst.shape().to_vec(),
                    expected: format!("{:?} {} (the source)", src.shape(), src.dtype()),
                });
            }
            let s = src.host().ok_or_else(|| $crate::backend::host_only($name, "src", src))?.clone();
            let err = $crate::backend::host_only($name, "dst", dst);
            *dst.host_mut().ok_or(err)? = s;
            Ok(())
        }
    };
}
pub(crate) use host_memory_impl;
